"""A checkpoint folder's files: their names, the manifest beside each checkpoint (what it holds,
where the data stood, its checksums), what a resume found, and the atomic writes that make a file
complete or absent."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from typing import Any, Callable

from mselastic.trainer.tensors import restore_rng_state

log = logging.getLogger("mselastic.trainer")
MANIFEST = re.compile(r"^ckpt-(\d{8,})(?:-g(\d{6,}))?\.json$")


def file_stem(step: int, generation: int | None) -> str:
    """A checkpoint's file name without its extension."""
    return f"ckpt-{step:08d}" + ("" if generation is None else f"-g{generation:06d}")


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
    #: MindSpore's random state when it was taken (:func:`rng_state`), restored by ``load``.
    rng: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The checkpoint folder's lineage (``latest.json``'s) when a snapshot was taken: a snapshot is
    #: only ever adopted into the folder whose history it continues.
    lineage: str = ""
    #: A snapshot's layout (its file holds the parameters' raw bytes, one after the other): each
    #: parameter's name, dtype (numpy's name for it, or MindSpore's: bfloat16) and shape; and the
    #: CRC32 of the whole file.
    tensors: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    crc32: int = 0

    def to_json(self) -> str:
        """The manifest's file; a checkpoint's without the snapshot's fields (a version from before
        them reads it: ``Manifest(**...)`` takes no unknown key)."""
        # (each field as it is, not dataclasses.asdict: its deep copy of the tensor list and the
        # random state was a third of a LeNet snapshot's time on the training thread)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not self.tensors:
            del fields["tensors"], fields["crc32"]
        return json.dumps(fields)


@dataclasses.dataclass(frozen=True)
class Resumed:
    manifest: Manifest
    params: dict[str, Any]
    #: Checkpoints that were newer but unusable, with the reason.
    skipped: tuple[tuple[str, str], ...] = ()

    def restore_rng(self) -> None:
        """MindSpore's random state as it was at the checkpoint (after the network is built)."""
        try:
            restore_rng_state(self.manifest.rng)
        except Exception as e:  # an old or foreign state: the resume goes on, only not bit-identical
            log.warning("random state of %s not restored (%s): dropout and other random operators draw anew",
                        self.manifest.file, e)

    @property
    def note(self) -> str:
        """One line for the agent's report when newer checkpoints had to be skipped."""
        if not self.skipped:
            return ""
        skipped = "; ".join(f"{name}: {why}" for name, why in self.skipped)
        return f"resumed from step {self.manifest.step} ({self.manifest.file}); skipped unusable {skipped}"


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: str) -> None:
    """fsync a file, or a folder (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str, midway: Callable[[], None] = lambda: None) -> None:
    """Temp file, fsync, rename. ``midway`` runs with half of ``text`` written (a fault point)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text[: len(text) // 2])
        f.flush()
        midway()
        f.write(text[len(text) // 2:])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
