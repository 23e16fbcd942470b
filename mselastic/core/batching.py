"""Valid world sizes and the batch layout that keeps the global batch constant.

As in DeepSpeed's elasticity: the job fixes the global batch ``G`` and, optionally,
the micro-batch sizes a rank may run (``micro_batch_sizes``; empty means any). A
world size ``w`` is valid when some allowed micro-batch ``m`` and a whole number
of accumulation steps ``a`` give ``w * m * a == G``; the largest such ``m`` is
used (fewest accumulation steps). The coordinator forms generations of valid
sizes only; the trainer library derives ``m`` and ``a`` from the same function,
so both sides agree by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    world_size: int
    #: Samples one rank runs per forward/backward pass.
    micro_batch: int
    #: Forward/backward passes per optimizer step (gradients summed, then averaged).
    accumulation_steps: int

    @property
    def per_rank(self) -> int:
        """Samples one rank consumes per optimizer step."""
        return self.micro_batch * self.accumulation_steps


def batch_layout(global_batch: int, world_size: int, micro_batch_sizes: Sequence[int] = ()) -> BatchLayout | None:
    """The layout for ``world_size`` ranks, or None when that size cannot keep ``global_batch``."""
    if world_size <= 0 or global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    if not micro_batch_sizes:
        return BatchLayout(world_size, per_rank, 1)
    fitting = [m for m in micro_batch_sizes if m > 0 and per_rank % m == 0]
    if not fitting:
        return None
    m = max(fitting)
    return BatchLayout(world_size, m, per_rank // m)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` > 0, ascending, in O(sqrt(n)) steps."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def valid_world_sizes(global_batch: int, lo: int, hi: int, micro_batch_sizes: Sequence[int] = ()) -> list[int]:
    """Valid world sizes in ``lo..hi``. A valid size divides ``global_batch``, so only its divisors
    are tried: the range itself may be huge (a spec's max_nodes is bounded, not small)."""
    if global_batch <= 0:
        return []
    return [w for w in divisors(global_batch)
            if max(lo, 1) <= w <= hi and batch_layout(global_batch, w, micro_batch_sizes) is not None]


def node_count(available: int, min_nodes: int, max_nodes: int, workers_per_node: int, global_batch: int,
               micro_batch_sizes: Sequence[int] = ()) -> int:
    """The most nodes (<= available, within min..max) whose world size is valid; 0 when none."""
    for n in range(min(available, max_nodes), min_nodes - 1, -1):
        if batch_layout(global_batch, n * workers_per_node, micro_batch_sizes) is not None:
            return n
    return 0
