"""How every rank comes to resume from the same checkpoint: rank 0 proposes its candidates, newest
first, each rank tries the proposal, and the first one every rank loaded is taken (two allreduces
per proposal). Steps and generations travel through the float32 allreduce as two halves below
2**20, exact. Pure but for the ``allreduce`` and ``read`` it is given."""

from __future__ import annotations

import logging
from typing import Callable, Sequence, TypeVar

from mselastic.trainer.layout import MANIFEST, file_stem

log = logging.getLogger("mselastic.trainer")

#: Candidates rank 0 proposes, newest first, before the ranks give up agreeing on one.
MAX_CANDIDATES = 8
#: Steps and generations travel through the (float32) allreduce as two halves below 2**20: exact.
HALF = 1 << 20
#: Errors that make a checkpoint unusable (the next older one is tried).
UNUSABLE = (OSError, ValueError, TypeError, RuntimeError, KeyError)

T = TypeVar("T")
Allreduce = Callable[[list[float]], Sequence[float]]


def encode(name: str) -> list[float]:
    """A manifest's name as rank 0 proposes it: [1, step's halves, (generation + 1)'s halves]."""
    found = MANIFEST.match(name)
    if found is None:
        raise ValueError(f"{name} is not a manifest's name")
    step, gen = int(found.group(1)), int(found.group(2)) + 1 if found.group(2) else 0
    return [1.0, step // HALF, step % HALF, gen // HALF, gen % HALF]


def decode(got: Sequence[int]) -> str | None:
    """The manifest's name a proposal names; None: no proposal (rank 0 has no more candidates)."""
    if not got[0]:
        return None
    gen = got[3] * HALF + got[4]
    return file_stem(got[1] * HALF + got[2], gen - 1 if gen else None) + ".json"


def agree(allreduce: Allreduce, rank: int, world: int, order: list[str],
          read: Callable[[str], T]) -> tuple[T | None, list[tuple[str, str]], int]:
    """(what every rank loaded, or None; the proposals skipped and why; how many ranks see a
    checkpoint of the job at all). ``order``: this rank's candidates (only rank 0's are proposed);
    ``read``: loads one, raising one of ``UNUSABLE``."""
    seen = int(allreduce([1.0 if order else 0.0])[0])
    skipped: list[tuple[str, str]] = []
    for i in range(MAX_CANDIDATES):
        proposal = encode(order[i]) if rank == 0 and i < len(order) else [0.0] * 5
        name = decode([int(v) for v in allreduce(proposal)])
        if name is None:
            break
        loaded, why = None, ""
        try:
            loaded = read(name)
        except UNUSABLE as e:
            why = str(e) or type(e).__name__
            log.warning("rank %d cannot load checkpoint %s (%s): the ranks try the previous one", rank, name, why)
        ok = int(allreduce([1.0 if loaded is not None else 0.0])[0])
        if ok == world and loaded is not None:
            return loaded, skipped, seen
        skipped.append((name, f"rank {rank}: {why}" if why else f"{world - ok} of {world} rank(s) could not load it"))
    return None, skipped, seen
