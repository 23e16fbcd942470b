"""The ranks' agreement on the checkpoint to resume from, as a table: ranks are threads, the
allreduce a sum over them (what MindSpore's does). No MindSpore, no processes."""

from __future__ import annotations

import threading
from typing import Sequence

import pytest

from mselastic.trainer import agreement


def run(world: int, order0: list[str], unreadable: dict[int, set[str]], others_see: bool = True) -> list[tuple]:
    """Every rank's (loaded, skipped, seen) when rank 0 proposes ``order0`` and rank r cannot read
    ``unreadable[r]``."""
    barrier, lock, sums, results = threading.Barrier(world), threading.Lock(), {}, [None] * world
    calls = [0] * world

    def allreduce_for(rank: int):  # type: ignore[no-untyped-def]
        def allreduce(values: list[float]) -> Sequence[float]:
            n = calls[rank]
            calls[rank] += 1
            with lock:
                acc = sums.setdefault(n, [0.0] * len(values))
                for i, v in enumerate(values):
                    acc[i] += v
            barrier.wait()
            return list(sums[n])
        return allreduce

    def rank_main(rank: int) -> None:
        def read(name: str) -> str:
            if name in unreadable.get(rank, set()):
                raise ValueError("checksum mismatch")
            return name
        order = order0 if rank == 0 or others_see else []
        results[rank] = agreement.agree(allreduce_for(rank), rank, world, order, read)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results  # type: ignore[return-value]


NEWEST, OLDER, OLDEST = "ckpt-00000030-g000002.json", "ckpt-00000020-g000001.json", "ckpt-00000010.json"


@pytest.mark.parametrize("name", [NEWEST, OLDER, OLDEST, "ckpt-123456789012-g999999.json"])
def test_a_proposal_names_its_checkpoint_exactly(name: str) -> None:
    assert agreement.decode([int(v) for v in agreement.encode(name)]) == name
    assert agreement.decode([0, 0, 0, 0, 0]) is None


@pytest.mark.parametrize("case, unreadable, others_see, loaded, skipped", [
    ("every rank loads the newest", {}, True, NEWEST, []),
    ("one rank cannot read the newest: all take the previous", {1: {NEWEST}}, True, OLDER, [NEWEST]),
    ("none is loadable everywhere: none, every proposal said why", {2: {NEWEST, OLDER, OLDEST}}, True, None,
     [NEWEST, OLDER, OLDEST]),
    ("only rank 0 proposes: the others' folders do not count", {}, False, NEWEST, []),
])
def test_every_rank_resumes_from_the_same_checkpoint(case: str, unreadable: dict[int, set[str]], others_see: bool,
                                                      loaded: str | None, skipped: list[str]) -> None:
    results = run(3, [NEWEST, OLDER, OLDEST], unreadable, others_see)
    assert [r[0] for r in results] == [loaded] * 3, case
    assert all([name for name, _ in r[1]] == skipped for r in results), case
    assert all(r[2] == (3 if others_see else 1) for r in results)


def test_no_checkpoint_anywhere_is_a_fresh_start() -> None:
    assert run(2, [], {}) == [(None, [], 0)] * 2
