"""The leader's admission and work queue as tables: which slots a job holds and may use (first
come, first served), when a plan being committed lets its slots go, and client-go's work-queue
rules (one worker per job, a failed job held back with a growing backoff). No etcd, no processes."""

from __future__ import annotations

import asyncio

import pytest

from mselastic.core.states import GenerationState as G
from mselastic.core.states import JobState as J
from mselastic.daemon import admission
from mselastic.daemon.workqueue import WorkQueue, requeue_delay_s
from tests.builders import cluster, node, plan_on, rep, view


def test_a_job_holds_its_plans_members_and_wherever_a_generation_still_runs() -> None:
    a = view("a", plan_on(0, 1), reports=[rep(0, G.RUNNING, job="a"), rep(1, G.RUNNING, job="a")])
    # Over, but its generation still stops on n1 (its report is not terminal): n1 stays held.
    b = view("b", plan_on(1, generation=3), state=J.STOPPED, reports=[rep(1, G.RUNNING, generation=3, job="b")])
    c = view("c", plan_on(0), state=J.SUCCEEDED, reports=[rep(0, G.SUCCEEDED, job="c")])
    held = admission.slots_held(cluster([node(0), node(1)], a, b, c), {})
    assert held == {"a": {"n0": 2, "n1": 2}, "b": {"n1": 2}}
    # A plan being committed (not in the view yet) holds its members too.
    assert admission.slots_held(cluster([node(0), node(1)], c), {"c": plan_on(1)}) == {"c": {"n1": 2}}


@pytest.mark.parametrize("name, queue_head, placed, free, says", [
    ("others' slots are not free", "", False, {"n0": 1, "n1": 2}, "node n0: 1 of 2 slot(s) free, the rest held by job(s) a"),
    ("own slots are", "", True, {"n0": 1, "n1": 2}, "node n0"),
    ("behind the queue's head: nothing", "q", False, {"n0": 0, "n1": 0}, "queued behind job q"),
    ("a running job is not queued", "q", True, {"n0": 1, "n1": 2}, "node n0"),
])
def test_free_slots_first_come_first_served(name: str, queue_head: str, placed: bool, free: dict[str, int],
                                            says: str) -> None:
    held = {"a": {"n0": 1}, "me": {"n0": 1, "n1": 2}}
    got, why = admission.free_slots("me", [node(0), node(1)], held, queue_head, placed)
    assert got == free and says in why, (got, why)


def test_a_plan_being_committed_holds_its_slots_until_the_view_shows_it() -> None:
    inflight = {"a": plan_on(0, generation=2), "b": plan_on(1, generation=5)}
    seen = cluster([node(0), node(1)], view("a", plan_on(0, generation=2)), view("b", plan_on(1, generation=4)))
    assert admission.settled(inflight, seen, busy=set()) == {"b": inflight["b"]}  # a's commit is seen
    assert admission.settled(inflight, seen, busy={"a"}) == inflight  # a's task still runs: held
    gone = cluster([node(0)], view("b", plan_on(1, generation=4), state=J.STOPPED))
    assert admission.settled(inflight, gone, busy=set()) == {}  # a deleted, b over: nothing held


def test_the_backoff_doubles_per_failure_up_to_a_minute_with_a_little_jitter() -> None:
    for n, base in [(1, 0.5), (2, 1.0), (3, 2.0), (8, 60.0), (1000, 60.0)]:
        assert base <= requeue_delay_s(n) <= base * 1.1


def test_one_worker_per_job_and_a_failed_job_is_held_back_until_its_backoff_is_over() -> None:
    async def run() -> None:
        queue, errors, gate = WorkQueue(), [], asyncio.Event()

        async def on_error(job: str, e: Exception) -> None:
            errors.append((job, str(e)))
            queue.failed(job)

        async def fail() -> None:
            raise RuntimeError("boom")

        queue.start("a", gate.wait(), on_error)
        assert "a" in queue and queue.held_back("a", 0.0) and queue.busy() == {"a"}
        queue.start("b", fail(), on_error)
        gate.set()
        await asyncio.sleep(0.01)
        assert "a" not in queue and not queue.held_back("a", 1e12)
        assert errors == [("b", "boom")] and "b" not in queue
        loop_now = asyncio.get_running_loop().time()
        assert queue.held_back("b", loop_now) and not queue.held_back("b", loop_now + 0.6)
        n, delay = queue.failed("b")
        assert n == 2 and 1.0 <= delay <= 1.1
        queue.forget("b")  # a deleted job: its backoff goes with it
        assert not queue.held_back("b", 0.0) and queue.failed("b")[0] == 1
        queue.start("c", asyncio.sleep(60), on_error)
        await asyncio.sleep(0)  # (its worker started)
        await queue.cancel()
        assert queue.busy() == set()

    asyncio.run(run())


def test_a_deleted_job_is_told_once_and_later_only_while_its_worker_runs() -> None:
    """The leader tells every node of a deleted job once: when a pass first misses it (or, at a
    term's first pass, for a job deleted just before), later if its worker is busy, never again
    after (each telling is a final Stop to every node), and not at all once the name is back."""
    from mselastic.daemon.coordinator import deleted_to_tell

    tell, later = deleted_to_tell({"a", "b", "c"}, set(), {"a"}, busy={"c"})
    assert tell == ["b"] and later == {"c"}
    known = {"a"}  # (the next pass: the last one saw only the jobs there were)
    tell, later = deleted_to_tell(known, later, {"a"}, busy=set())
    assert tell == ["c"] and later == set()
    assert deleted_to_tell({"a"}, later, {"a"}, busy=set()) == ([], set())  # told: never again
    assert deleted_to_tell(set(), {"d", "e"}, {"e"}, busy=set()) == (["d"], set())  # (e submitted again)
