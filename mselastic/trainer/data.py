"""Exactly-once samples across world-size changes.

Each epoch has one permutation of the data set, drawn from ``(seed, epoch)`` and so
the same on every rank and in every generation. Step ``k`` of an epoch consumes
positions ``k*G .. (k+1)*G - 1`` of it (``G`` the global batch), whatever the world
size: the checkpoint records the epoch, the seed and the global sample cursor
(positions already consumed), and a resume at any world size starts the sampler at
that cursor. The ``N mod G`` samples at the end of an epoch's permutation are not
part of that epoch (as with ``drop_remainder``); the next epoch is a new permutation.

This module is the one source of truth for that order: :func:`permutation` and :func:`step_share`
(what rank ``r`` of ``w`` trains on at a step); the three-line API's sampler
(``mselastic.trainer.elastic``) hands out exactly :func:`step_share`'s indices, and
:class:`ElasticData`'s sampler deals the same positions through MindSpore's samplers.

The split over ranks is MindSpore's own ``DistributedSampler(num_shards, shard_id,
shuffle=False)`` over a ``SubsetSampler`` of the epoch's remaining positions: it
deals them out round-robin, so rank ``r`` of ``w`` gets positions ``r, r+w, ...``
and every run of ``G`` consecutive positions is spread over all ranks, ``G/w``
each — one step's global batch. Any mappable dataset (``MnistDataset``,
``MindDataset``, ``NumpySlicesDataset``...) takes it as its ``sampler``. We do not
use ``Dataset.skip`` or ``set_init_step``: both count in the *previous* world
size's batches and cannot move a cursor between world sizes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mselastic.trainer.checkpoint import Resumed
    from mselastic.trainer.context import ElasticContext


def permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The order of the data set in ``epoch``: the same on every rank, in every generation."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def step_share(order: np.ndarray, offset: int, global_batch: int, rank: int, world: int) -> list[int]:
    """Rank ``rank`` of ``world``'s samples at step ``offset`` of an epoch whose order is ``order``:
    positions ``offset*G + rank, offset*G + rank + world, ...`` of the step's ``G`` positions."""
    return [int(i) for i in order[offset * global_batch + rank: (offset + 1) * global_batch: world]]


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the job is in its data: saved in every checkpoint."""

    epoch: int
    #: Positions of this epoch's permutation already consumed, over all ranks.
    cursor: int
    seed: int


class ElasticData:
    def __init__(self, ctx: "ElasticContext", num_samples: int, seed: int) -> None:
        self.ctx = ctx
        self.num_samples = num_samples
        self.seed = seed
        self.steps_per_epoch = num_samples // ctx.global_batch_size
        if self.steps_per_epoch == 0:
            raise SystemExit(f"mselastic: global batch {ctx.global_batch_size} is larger than the "
                             f"{num_samples} samples of the data set")

    @property
    def epoch_samples(self) -> int:
        return self.steps_per_epoch * self.ctx.global_batch_size

    def start(self, resumed: "Resumed | None") -> Position:
        """The position to start from: the checkpoint's, or the beginning."""
        if resumed is None:
            return Position(0, 0, self.seed)
        m = resumed.manifest
        if m.seed != self.seed or m.cursor % self.ctx.global_batch_size or m.cursor >= self.epoch_samples:
            raise SystemExit(f"mselastic: checkpoint {m.file} has seed {m.seed} and cursor {m.cursor}, which do not "
                             f"fit seed {self.seed}, global batch {self.ctx.global_batch_size} and "
                             f"{self.num_samples} samples; was the job changed?")
        return Position(m.epoch, m.cursor, m.seed)

    def permutation(self, epoch: int) -> np.ndarray:
        return permutation(self.seed, epoch, self.num_samples)

    def steps_left(self, pos: Position) -> int:
        """Steps left in the position's epoch."""
        return (self.epoch_samples - pos.cursor) // self.ctx.global_batch_size

    def sampler(self, pos: Position) -> Any:
        """This rank's sampler for the rest of ``pos``'s epoch."""
        import mindspore.dataset as ds

        order = self.permutation(pos.epoch)[pos.cursor: self.epoch_samples]
        s = ds.DistributedSampler(num_shards=self.ctx.num_shards, shard_id=self.ctx.shard_id, shuffle=False)
        s.add_child(ds.SubsetSampler(order.tolist()))
        return s

    def advance(self, pos: Position) -> Position:
        """The position after one optimizer step."""
        cursor = pos.cursor + self.ctx.global_batch_size
        if cursor >= self.epoch_samples:
            return Position(pos.epoch + 1, 0, pos.seed)
        return Position(pos.epoch, cursor, pos.seed)
