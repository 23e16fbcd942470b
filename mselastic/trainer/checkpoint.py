"""Checkpoints that survive crashes at any instant, and a resume that never trusts a bad one.

Layout in the job's checkpoint folder::

    ckpt-00000120.ckpt    MindSpore checkpoint (crc_check on save and load)
    ckpt-00000120.json    manifest: step, data position (epoch, seed, global sample cursor),
                          world size, generation, sha256, size
    latest.json           pointer to the newest complete manifest

A checkpoint is complete once its manifest exists: the ``.ckpt`` is written and
fsynced first, then the manifest (temp file, fsync, rename), then the pointer,
then the folder is fsynced. Only rank 0 writes (data parallel: every rank holds
the same parameters). ``load`` takes the pointer's checkpoint, or else the
newest manifest; one whose checksum or CRC fails is skipped with a warning and
the previous one is used. The last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
from typing import Any

from mselastic.core.contract import LATEST_CHECKPOINT

log = logging.getLogger("mselastic.trainer")
_MANIFEST = re.compile(r"^ckpt-(\d{8,})\.json$")


@dataclasses.dataclass(frozen=True)
class Manifest:
    step: int
    epoch: int
    world_size: int
    generation: int
    file: str
    sha256: str
    size: int
    #: Positions of the epoch's permutation consumed (see :mod:`mselastic.trainer.data`).
    cursor: int = 0
    seed: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Resumed:
    manifest: Manifest
    params: dict[str, Any]
    #: Checkpoints that were newer but unusable, with the reason.
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def note(self) -> str:
        """One line for the agent's report when newer checkpoints had to be skipped."""
        if not self.skipped:
            return ""
        skipped = "; ".join(f"{name}: {why}" for name, why in self.skipped)
        return f"resumed from step {self.manifest.step} ({self.manifest.file}); skipped unusable {skipped}"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpointer:
    def __init__(self, directory: str, rank: int, world_size: int, generation: int, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.dir = directory
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.keep = keep
        os.makedirs(directory, exist_ok=True)

    @classmethod
    def from_context(cls, ctx: Any) -> "Checkpointer":
        return cls(ctx.checkpoint_dir, ctx.rank, ctx.world_size, ctx.generation, ctx.keep_checkpoints)

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def save(self, obj: Any, step: int, epoch: int, cursor: int = 0, seed: int = 0,
             extra: dict[str, Any] | None = None) -> Manifest | None:
        """Write a checkpoint of ``obj`` at ``step``; rank 0 only. ``obj``: the optimizer, whose
        parameters are the network's plus its own state (momentum buffers, learning rate, global
        step), so all of it is carried across relaunches."""
        if not self.writer:
            return None
        import mindspore as ms

        name = f"ckpt-{step:08d}"
        path = os.path.join(self.dir, name + ".ckpt")
        ms.save_checkpoint(obj, path, crc_check=True)
        _fsync_file(path)
        manifest = Manifest(step=step, epoch=epoch, world_size=self.world_size, generation=self.generation,
                            file=name + ".ckpt", sha256=_sha256(path), size=os.path.getsize(path), cursor=cursor,
                            seed=seed, extra=extra or {})
        _write_atomic(os.path.join(self.dir, name + ".json"), json.dumps(dataclasses.asdict(manifest)))
        _write_atomic(os.path.join(self.dir, LATEST_CHECKPOINT), json.dumps({"manifest": name + ".json"}))
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._prune()
        return manifest

    def manifests(self) -> list[str]:
        """Manifest file names, newest step first."""
        names = [os.path.basename(p) for p in glob.glob(os.path.join(self.dir, "ckpt-*.json"))]
        return sorted((n for n in names if _MANIFEST.match(n)), reverse=True)

    def _prune(self) -> None:
        for name in self.manifests()[self.keep:]:
            stem = name[: -len(".json")]
            for suffix in (".json", ".ckpt"):
                try:
                    os.remove(os.path.join(self.dir, stem + suffix))
                except FileNotFoundError:
                    pass

    def load(self) -> Resumed | None:
        """The newest valid checkpoint, or None for a fresh start."""
        import mindspore as ms

        order = self.manifests()
        try:
            with open(os.path.join(self.dir, LATEST_CHECKPOINT)) as f:
                pointed = json.load(f)["manifest"]
            if pointed in order:
                order.remove(pointed)
                order.insert(0, pointed)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        skipped: list[tuple[str, str]] = []
        for name in order:
            try:
                with open(os.path.join(self.dir, name)) as f:
                    m = Manifest(**json.load(f))
                path = os.path.join(self.dir, m.file)
                if os.path.getsize(path) != m.size or _sha256(path) != m.sha256:
                    raise ValueError("checksum mismatch")
                params = ms.load_checkpoint(path, crc_check=True)
            except (OSError, ValueError, TypeError, RuntimeError) as e:
                log.warning("checkpoint %s unusable (%s); trying the previous one", name, e)
                skipped.append((name, str(e)))
                continue
            if skipped:
                log.warning("resuming from %s (step %d) instead of newer %s", name, m.step,
                            ", ".join(n for n, _ in skipped))
            return Resumed(m, params, tuple(skipped))
        return None
