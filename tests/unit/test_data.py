"""The one sample stream (mselastic.trainer.data) as a table: every step's global batch is dealt
over the ranks once each, at any world size, in the order MindSpore's DistributedSampler deals the
epoch's remaining positions (rank r of w: positions r, r+w, ... after the cursor). No MindSpore."""

from __future__ import annotations

import pytest

from mselastic.trainer.data import permutation, step_share

G, N = 32, 100


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16, 32])
def test_each_step_deals_its_global_batch_once_over_the_ranks(world: int) -> None:
    order = permutation(7, 3, N)
    assert sorted(order.tolist()) == list(range(N)) and (order == permutation(7, 3, N)).all()
    for step in range(N // G):
        shares = [step_share(order, step, G, r, world) for r in range(world)]
        assert all(len(s) == G // world for s in shares)
        assert sorted(i for s in shares for i in s) == sorted(order[step * G:(step + 1) * G].tolist())
        # DistributedSampler(num_shards=world, shard_id=r) over the positions from the cursor on.
        rest = order[step * G:].tolist()
        for r, share in enumerate(shares):
            assert share == rest[r::world][:G // world]


def test_a_resume_at_another_world_size_continues_with_the_samples_not_yet_used() -> None:
    """Steps 0-1 at world size 4, then steps 2-... at world size 2: no sample of the epoch twice."""
    order = permutation(0, 0, N)
    used = [i for step in (0, 1) for r in range(4) for i in step_share(order, step, G, r, 4)]
    used += [i for r in range(2) for i in step_share(order, 2, G, r, 2)]
    assert len(used) == len(set(used)) == 3 * G


def test_epochs_have_their_own_order() -> None:
    assert (permutation(0, 0, N) != permutation(0, 1, N)).any()
