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

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
from typing import Any

from mselastic.core.contract import LATEST_CHECKPOINT

log = logging.getLogger("mselastic.trainer")
_MANIFEST = re.compile(r"^ckpt-(\d{8,})(-g\d{6,})?\.json$")


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
    #: The job that wrote it ("" before this field existed, or under plain msrun): a job never
    #: resumes another job's checkpoints.
    job: str = ""


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
    """Checkpoints of one job in its ``checkpoint_dir``, fenced by generation.

    ``latest.json`` names the newest published manifest and the generation that owns the
    directory. Rank 0 of a generation claims it when it loads (before its first save), and a
    writer never moves it back to an older generation: the ranks of a generation that was
    replaced while cut off (a partition, a stall) may still reach the shared storage, and their
    saves are then withdrawn instead of published over the newer generation's. File names carry
    the generation too, so two generations never write the same file."""

    def __init__(self, directory: str, rank: int, world_size: int, generation: int, keep: int = 3,
                 job: str = "") -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.dir = directory
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.keep = keep
        self.job = job
        os.makedirs(directory, exist_ok=True)

    @classmethod
    def from_context(cls, ctx: Any) -> "Checkpointer":
        job = ctx.job if ctx.generation else ""  # plain msrun (generation 0): no owner to check
        return cls(ctx.checkpoint_dir, ctx.rank, ctx.world_size, ctx.generation, ctx.keep_checkpoints, job)

    def _latest(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.dir, LATEST_CHECKPOINT)) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _publish(self, manifest: str | None) -> bool:
        """Point latest at ``manifest`` (None: keep the pointer, claim the directory for this
        generation), under a lock, unless a newer generation of this job owns it. False: refused.
        Plain msrun (generation 0) is not fenced; another job's pointer is taken over (Submit
        refuses a checkpoint_dir that a job still existing uses, so that job was deleted)."""
        with open(os.path.join(self.dir, ".latest.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = self._latest()
            owner, same_job = current.get("generation", 0), current.get("job", "") in ("", self.job)
            if self.generation and same_job and isinstance(owner, int) and owner > self.generation:
                return False
            pointer = manifest or current.get("manifest")
            if pointer is None:
                return True
            _write_atomic(os.path.join(self.dir, LATEST_CHECKPOINT),
                          json.dumps({"manifest": pointer, "generation": self.generation, "job": self.job}))
        return True

    def claim(self) -> None:
        """Rank 0 of a new generation: from now on no older generation publishes here."""
        if self.writer and self.generation and not self._publish(None):
            raise SystemExit(f"mselastic: generation {self._latest().get('generation')} already owns "
                             f"{self.dir}; this generation ({self.generation}) was replaced")

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

        name = f"ckpt-{step:08d}-g{self.generation:06d}"
        path = os.path.join(self.dir, name + ".ckpt")
        ms.save_checkpoint(obj, path, crc_check=True)
        _fsync_file(path)
        manifest = Manifest(step=step, epoch=epoch, world_size=self.world_size, generation=self.generation,
                            file=name + ".ckpt", sha256=_sha256(path), size=os.path.getsize(path), cursor=cursor,
                            seed=seed, extra=extra or {}, job=self.job)
        _write_atomic(os.path.join(self.dir, name + ".json"), json.dumps(dataclasses.asdict(manifest)))
        if not self._publish(name + ".json"):
            # Replaced while cut off: withdraw the files, nobody may resume from them.
            for suffix in (".json", ".ckpt"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.dir, name + suffix))
            log.error("checkpoint of step %d withdrawn: generation %s owns %s, this one (%d) was replaced",
                      step, self._latest().get("generation"), self.dir, self.generation)
            return None
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
        """Keep the newest ``keep`` of this job's checkpoints (another job's files are not ours)."""
        for name in [n for n in self.manifests() if self._owner(n) in ("", self.job)][self.keep:]:
            stem = name[: -len(".json")]
            for suffix in (".json", ".ckpt"):
                try:
                    os.remove(os.path.join(self.dir, stem + suffix))
                except FileNotFoundError:
                    pass

    def _owner(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, name)) as f:
                job = json.load(f).get("job", "")
            return job if isinstance(job, str) else ""
        except (OSError, ValueError, AttributeError):
            return ""

    def load(self) -> Resumed | None:
        """The newest valid checkpoint of this job, or None for a fresh start. Rank 0 then claims
        the directory for this generation (see :meth:`claim`)."""
        try:
            return self._load()
        finally:
            self.claim()

    def _load(self) -> Resumed | None:
        import mindspore as ms

        order = self.manifests()
        latest = self._latest()
        pointed = latest.get("manifest")
        if pointed in order:
            order.remove(pointed)
            order.insert(0, pointed)
        skipped: list[tuple[str, str]] = []
        for name in order:
            try:
                with open(os.path.join(self.dir, name)) as f:
                    m = Manifest(**json.load(f))
                if m.job and self.job and m.job != self.job:
                    raise ValueError(f"written by job {m.job}, not {self.job}")
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
