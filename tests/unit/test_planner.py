"""The planner as a table: state + plan + reports + nodes -> decision. No etcd, no processes."""

from __future__ import annotations

import pytest

import dataclasses
from typing import Any

from mselastic.core.model import AGENT_RESTARTED, GenerationReport, JobStatus, NodeRecord, Plan
from mselastic.core.planner import RESERVED_PORTS, Action, PortRange, decide, make_plan, master_port
from tests.builders import SPEC, node, plan_on, rep, st
from mselastic.core.spec import JobSpec
from mselastic.core.states import FailureCause
from mselastic.core.states import GenerationState as G
from mselastic.core.states import JobState as J

CASES = [
    # (id, state, plan, reports, nodes, action, members of the new plan, generation)
    ("no nodes: wait", J.PENDING, None, [], [], Action.WAIT, None, None),
    ("node too small: wait", J.PENDING, None, [], [node(0, slots=1)], Action.WAIT, None, None),
    ("first launch, oldest first", J.PENDING, None, [], [node(2, rev=9), node(1, rev=3), node(0, rev=5)],
     Action.LAUNCH, ["n1", "n0"], 1),
    ("healthy: nothing", J.RUNNING, plan_on(0, 1), [rep(0, G.RUNNING), rep(1, G.RUNNING)], [node(0), node(1)],
     Action.NOTHING, None, None),
    ("all succeeded", J.RUNNING, plan_on(0, 1), [rep(0, G.SUCCEEDED), rep(1, G.SUCCEEDED)], [node(0), node(1)],
     Action.SUCCEED, None, None),
    ("one succeeded only", J.RUNNING, plan_on(0, 1), [rep(0, G.SUCCEEDED)], [node(0), node(1)],
     Action.NOTHING, None, None),
    ("rank failed: relaunch same nodes", J.RUNNING, plan_on(0, 1), [rep(1, G.FAILED, rank=3)], [node(0), node(1)],
     Action.LAUNCH, ["n0", "n1"], 2),
    ("node lost: relaunch without it", J.RUNNING, plan_on(0, 1), [], [node(1)], Action.LAUNCH, ["n1"], 2),
    ("survivors keep order, newcomer appended", J.RUNNING, plan_on(1, 0), [rep(1, G.FAILED)],
     [node(0), node(1), node(5, rev=0)], Action.LAUNCH, ["n1", "n0"], 2),
    ("stale report of old generation ignored", J.RUNNING, plan_on(0, generation=2),
     [rep(0, G.FAILED, generation=1)], [node(0)], Action.NOTHING, None, None),
    ("restarts exhausted", J.RUNNING, plan_on(0, restarts=2), [rep(0, G.FAILED)], [node(0)], Action.FAIL, None, None),
    ("below min_nodes after loss: wait", J.RUNNING, plan_on(0), [], [], Action.WAIT, None, None),
    ("terminal: nothing", J.SUCCEEDED, plan_on(0), [rep(0, G.FAILED)], [node(0)], Action.NOTHING, None, None),
    ("ranks exited on an outside SIGTERM: relaunch", J.RUNNING, plan_on(0, 1), [rep(1, G.STOPPED)],
     [node(0), node(1)], Action.LAUNCH, ["n0", "n1"], 2),
    ("cordoned member keeps running", J.RUNNING, plan_on(0, 1), [rep(0, G.RUNNING), rep(1, G.RUNNING)],
     [node(0), dataclasses.replace(node(1), cordoned=True)], Action.NOTHING, None, None),
    ("cordoned member left out of a relaunch", J.RUNNING, plan_on(0, 1), [rep(0, G.FAILED)],
     [node(0), dataclasses.replace(node(1), cordoned=True)], Action.LAUNCH, ["n0"], 2),
    ("stopped: nothing", J.STOPPED, None, [], [node(0)], Action.NOTHING, None, None),
]


@pytest.mark.parametrize("state, plan, reports, nodes, action, members, generation",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(state, plan, reports, nodes, action, members, generation):  # type: ignore[no-untyped-def]
    d = decide(SPEC, state, plan, {r.node_id: r for r in reports}, nodes)
    assert d.action is action, d.reason
    if members is not None:
        assert d.plan is not None
        assert [m.node_id for m in d.plan.members] == members
        assert [m.node_rank for m in d.plan.members] == list(range(len(members)))
        assert d.plan.generation == generation
        assert d.plan.world_size == 2 * len(members)
        assert d.plan.master_addr == d.plan.members[0].host
        if plan is not None:
            assert d.plan.master_port != plan.master_port
            assert d.plan.restart_count == plan.restart_count + 1 and not d.plan.planned


def test_first_failure_is_the_earliest_detected() -> None:
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), {"n0": rep(0, G.FAILED, rank=1, at=20.0),
                                                "n1": rep(1, G.FAILED, rank=2, at=10.0)}, [node(0), node(1)])
    assert d.fault is not None and d.fault.node_id == "n1" and "rank 2" in d.reason


def test_master_port_changes_and_stays_outside_msrun_ranges() -> None:
    ports = PortRange()
    seen = []
    for g in range(1, 200):
        p = master_port("job", g, seen[-1] if seen else None, ports)
        assert p not in RESERVED_PORTS and ports.start <= p < ports.start + ports.span
        assert not seen or p != seen[-1]
        seen.append(p)


@pytest.mark.parametrize("start, span", [(8000, 500), (15000, 2000), (100, 10), (65000, 1000)])
def test_bad_port_ranges_refused(start: int, span: int) -> None:
    with pytest.raises(ValueError):
        PortRange(start, span)


def test_salt_separates_clusters_choosing_ports_for_same_job() -> None:
    ports = PortRange()
    chosen = {master_port("lenet", 1, None, ports, salt) for salt in range(50)}
    assert len(chosen) > 40


@pytest.mark.parametrize("plan, reports, nodes", [
    (None, [], []),  # never had enough nodes
    (plan_on(0, 1), [], [node(0)], ),  # lost one below min_nodes (2) after a launch
])
def test_waiting_for_min_nodes_fails_after_the_timeout(plan, reports, nodes):  # type: ignore[no-untyped-def]
    spec = JobSpec(name="job", script="/s.py", checkpoint_dir="/c", workers_per_node=2, min_nodes=2, max_nodes=2,
                   min_nodes_timeout_s=30)
    state = J.PENDING if plan is None else J.RUNNING
    reps = {r.node_id: r for r in reports}
    assert decide(spec, state, plan, reps, nodes).action is Action.WAIT  # not waiting yet: just wait
    assert decide(spec, state, plan, reps, nodes, now=129.0, status=st(state, waiting_since=100.0)).action is Action.WAIT
    d = decide(spec, state, plan, reps, nodes, now=131.0, status=st(state, waiting_since=100.0))
    assert d.action is Action.FAIL and "min_nodes_timeout_s=30" in d.reason


def test_quarantine_after_repeated_failures_with_doubling_cooldown() -> None:
    spec = JobSpec(name="job", script="/s.py", checkpoint_dir="/c", workers_per_node=2, min_nodes=1, max_nodes=2,
                   max_restarts=10, quarantine_after_failures=2, quarantine_cooldown_s=60)
    nodes = [node(0), node(1)]
    # First failure on n1: counted, not yet quarantined.
    d1 = decide(spec, J.RUNNING, plan_on(0, 1), {"n1": rep(1, G.FAILED)}, nodes, now=1000.0)
    assert d1.action is Action.LAUNCH and d1.node_failures == {"n1": 1} and not d1.quarantined_until
    assert d1.plan is not None and [m.node_id for m in d1.plan.members] == ["n0", "n1"]
    # Second: quarantined for the base cooldown, left out of the new generation.
    d2 = decide(spec, J.RUNNING, plan_on(0, 1, generation=2, restarts=1), {"n1": rep(1, G.FAILED, generation=2)},
                nodes, now=1100.0, status=st(node_failures=d1.node_failures))
    assert d2.quarantined_until == {"n1": 1160.0} and "quarantined: n1" in d2.reason
    assert d2.plan is not None and [m.node_id for m in d2.plan.members] == ["n0"]
    # While quarantined it is not eligible; once the cooldown has passed it is again.
    during = decide(spec, J.PENDING, None, {}, nodes, now=1159.0, status=st(quarantined_until=d2.quarantined_until))
    assert during.plan is not None and [m.node_id for m in during.plan.members] == ["n0"]
    back = decide(spec, J.PENDING, None, {}, nodes, now=1161.0, status=st(quarantined_until=d2.quarantined_until))
    assert back.plan is not None and len(back.plan.members) == 2
    # A third failure doubles the cooldown.
    d3 = decide(spec, J.RUNNING, plan_on(0, 1, generation=3, restarts=2), {"n1": rep(1, G.FAILED, generation=3)},
                nodes, now=2000.0, status=st(node_failures=d2.node_failures, quarantined_until=d2.quarantined_until))
    assert d3.quarantined_until == {"n1": 2120.0}


def test_a_fault_seen_again_while_waiting_is_counted_once() -> None:
    spec = JobSpec(name="job", script="/s.py", checkpoint_dir="/c", workers_per_node=2, min_nodes=2, max_nodes=2,
                   max_restarts=5, quarantine_after_failures=3)
    plan, reps, nodes = plan_on(0, 1), {"n1": rep(1, G.FAILED)}, [node(0)]  # n1 failed and then was lost
    first = decide(spec, J.RUNNING, plan, reps, nodes, now=10.0)
    assert first.action is Action.WAIT and first.node_failures == {"n1": 1} and first.failures_counted_through == 1
    again = decide(spec, J.RESTARTING, plan, reps, nodes, now=11.0,
                   status=st(J.RESTARTING, node_failures=first.node_failures,
                             failures_counted_through=first.failures_counted_through))
    assert again.node_failures == {"n1": 1}


# -- elastic range: valid world sizes, drain, scale-up -------------------------------------------

ELASTIC = JobSpec(name="job", script="/s.py", checkpoint_dir="/c", workers_per_node=1, min_nodes=1, max_nodes=4,
                  global_batch_size=32, scale_up_settle_s=10)


def one(i: int, **kw: Any) -> NodeRecord:
    return dataclasses.replace(node(i, slots=1), **kw)


def elastic_plan(*ids: int, generation: int = 1, restarts: int = 0) -> Plan:
    return make_plan(ELASTIC, [one(i) for i in ids], generation, restarts, "t", None, PortRange())


def running(*ids: int, generation: int = 1) -> dict[str, GenerationReport]:
    return {f"n{i}": rep(i, G.RUNNING, generation=generation) for i in ids}


def test_only_valid_world_sizes_are_formed_and_idle_nodes_are_named() -> None:
    spec = dataclasses.replace(ELASTIC, global_batch_size=24)  # valid: 1, 2, 3, 4
    d = decide(spec, J.PENDING, None, {}, [one(i) for i in range(5)])
    assert d.plan is not None and d.plan.world_size == 4 and "n4 idle: max_nodes=4" in d.reason
    spec = dataclasses.replace(ELASTIC, global_batch_size=20, max_nodes=4)  # valid: 1, 2, 4
    d = decide(spec, J.PENDING, None, {}, [one(i) for i in range(3)])
    assert d.plan is not None and [m.node_id for m in d.plan.members] == ["n0", "n1"]
    assert "n2 idle: global_batch_size=20 needs a world size in [1, 2, 4]" in d.reason
    # After losing a node of four, three are left: a relaunch on two, one named idle.
    d = decide(spec, J.RUNNING, elastic_plan(0, 1, 2, 3), {}, [one(0), one(1), one(3)])
    assert d.action is Action.LAUNCH and d.plan is not None
    assert [m.node_id for m in d.plan.members] == ["n0", "n1"] and "n3 idle" in d.reason


def test_micro_batch_sizes_limit_the_world_sizes() -> None:
    spec = dataclasses.replace(ELASTIC, global_batch_size=32, micro_batch_sizes=(8,), min_nodes=1, max_nodes=8)
    assert spec.valid_world_sizes() == [1, 2, 4]
    d = decide(spec, J.PENDING, None, {}, [one(i) for i in range(7)])
    assert d.plan is not None and d.plan.world_size == 4


def test_drain_is_a_planned_relaunch_without_the_node() -> None:
    nodes = [one(0), one(1, cordoned=True, draining=True)]
    d = decide(ELASTIC, J.RUNNING, elastic_plan(0, 1), running(0, 1), nodes)
    assert d.action is Action.LAUNCH and d.plan is not None and d.plan.planned
    assert [m.node_id for m in d.plan.members] == ["n0"] and d.plan.restart_count == 0
    assert "drain of n1" in d.reason
    # A drain that would leave fewer than min_nodes waits and says so.
    spec = dataclasses.replace(ELASTIC, min_nodes=2)
    d = decide(spec, J.RUNNING, elastic_plan(0, 1), running(0, 1), nodes)
    assert d.action is Action.NOTHING and "drain of n1 waits" in d.note
    # ... unless an idle node can take its place.
    d = decide(spec, J.RUNNING, elastic_plan(0, 1), running(0, 1), nodes + [one(2)])
    assert d.plan is not None and [m.node_id for m in d.plan.members] == ["n0", "n2"]


def test_scale_up_waits_for_the_settle_window_and_takes_every_join_at_once() -> None:
    plan = elastic_plan(0)
    d1 = decide(ELASTIC, J.RUNNING, plan, running(0), [one(0), one(1)], now=100.0)
    assert d1.action is Action.NOTHING and d1.scale_up_nodes == ("n1",) and d1.scale_up_since == 100.0
    assert "scale-up pending" in d1.note
    # Another join restarts the window.
    status = st(scale_up_nodes=d1.scale_up_nodes, scale_up_since=d1.scale_up_since)
    d2 = decide(ELASTIC, J.RUNNING, plan, running(0), [one(0), one(1), one(2)], now=105.0, status=status)
    assert d2.action is Action.NOTHING and d2.scale_up_nodes == ("n1", "n2") and d2.scale_up_since == 105.0
    status = st(scale_up_nodes=d2.scale_up_nodes, scale_up_since=d2.scale_up_since)
    assert decide(ELASTIC, J.RUNNING, plan, running(0), [one(0), one(1), one(2)], now=114.0,
                  status=status).action is Action.NOTHING
    # One relaunch for both joins, to the largest valid size (3 of 32 is not: 2 nodes).
    d3 = decide(ELASTIC, J.RUNNING, plan, running(0), [one(0), one(1), one(2)], now=115.5, status=status)
    assert d3.action is Action.LAUNCH and d3.plan is not None and d3.plan.planned
    assert [m.node_id for m in d3.plan.members] == ["n0", "n1"] and "n2 idle" in d3.reason
    assert d3.plan.restart_count == 0 and d3.plan.generation == 2


def test_no_scale_up_before_every_rank_started_or_when_no_larger_size_is_valid() -> None:
    plan = elastic_plan(0)
    status = st(scale_up_nodes=("n1",), scale_up_since=1.0)
    starting = {"n0": rep(0, G.STARTING)}
    d = decide(ELASTIC, J.RUNNING, plan, starting, [one(0), one(1)], now=100.0, status=status)
    assert d.action is Action.NOTHING and "every rank has started" in d.note
    spec = dataclasses.replace(ELASTIC, global_batch_size=20)  # valid 1, 2, 4: running on 2, a third joins
    d = decide(spec, J.RUNNING, elastic_plan(0, 1), running(0, 1), [one(0), one(1), one(2)], now=100.0)
    assert d.action is Action.NOTHING and "n2 idle" in d.note and not d.scale_up_nodes


def test_a_job_submitted_again_after_delete_continues_the_generation_numbers() -> None:
    d = decide(SPEC, J.PENDING, None, {}, [node(0)], status=st(J.PENDING, generation=7))  # deleted after 7
    assert d.action is Action.LAUNCH and d.plan is not None and d.plan.generation == 8 and d.kind == "initial"
    assert decide(SPEC, J.PENDING, None, {}, [node(0)]).plan.generation == 1  # type: ignore[union-attr]


def test_a_report_closed_by_a_restarted_elasticd_is_a_lost_node() -> None:
    closed = dataclasses.replace(rep(1, G.FAILED), reason=AGENT_RESTARTED, cause=FailureCause.AGENT_RESTARTED)
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), {"n0": rep(0, G.RUNNING), "n1": closed}, [node(0), node(1)])
    assert d.action is Action.LAUNCH and d.kind == "node_lost" and d.plan is not None and d.plan.generation == 2
    assert d.reason.startswith(f"on node n1, {AGENT_RESTARTED}"), d.reason


def test_a_launch_the_spec_makes_impossible_fails_the_job_at_once_without_a_restart() -> None:
    def bad(i: int) -> GenerationReport:
        return dataclasses.replace(rep(i, G.FAILED), cause=FailureCause.LAUNCH_SPEC,
                                   reason="checkpoint_dir /proc/x cannot be created: No such file or directory")
    nodes = [node(0), node(1)]
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), {"n0": bad(0), "n1": bad(1)}, nodes, now=10)
    assert d.action is Action.FAIL and "checkpoint_dir /proc/x" in d.reason and d.kind == "launch_error"
    assert d.node_failures is None and d.quarantined_until is None  # no node is blamed for the spec
    # Until every member has said, wait; a member that started makes it that node's problem (a missing mount).
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), {"n1": bad(1)}, nodes, now=10)
    assert d.action is Action.NOTHING and "waiting for the other members" in d.note
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), {"n0": rep(0, G.RUNNING), "n1": bad(1)}, nodes, now=10)
    assert d.action is Action.LAUNCH and d.node_failures == {"n1": 1} and d.kind == "launch_error"


def test_a_node_local_launch_error_is_a_counted_relaunch_blamed_on_the_node() -> None:
    bad = dataclasses.replace(rep(1, G.FAILED), cause=FailureCause.LAUNCH_NODE, reason="msrun not found")
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), {"n1": bad}, [node(0), node(1)], now=10)
    assert d.action is Action.LAUNCH and d.plan is not None and d.plan.restart_count == 1
    assert d.kind == "launch_error" and d.node_failures == {"n1": 1}


def test_slots_held_by_other_jobs_are_not_used_and_the_wait_names_the_holder() -> None:
    d = decide(SPEC, J.PENDING, None, {}, [node(0), node(1)], free_slots={"n0": 0, "n1": 1},
               busy="slots held by job a on n0, n1")
    assert d.action is Action.WAIT and d.reason.endswith("slots held by job a on n0, n1"), d.reason
    d = decide(SPEC, J.PENDING, None, {}, [node(0), node(1)], free_slots={"n0": 0, "n1": 2})
    assert d.action is Action.LAUNCH and d.plan is not None and [m.node_id for m in d.plan.members] == ["n1"]


def test_a_join_that_only_has_slots_of_another_job_does_not_scale_up() -> None:
    d = decide(dataclasses.replace(SPEC, scale_up_settle_s=1), J.RUNNING, plan_on(0), {"n0": rep(0, G.RUNNING)},
               [node(0), node(1)], now=100, free_slots={"n0": 2, "n1": 0})
    assert d.action is Action.NOTHING and not d.scale_up_nodes


def test_a_rank_that_cannot_go_on_fails_the_job_without_a_restart_or_blame() -> None:
    fatal = dataclasses.replace(rep(1, G.FAILED), cause=FailureCause.TRAINER_FATAL, failed_rank=1,
                                reason="cannot go on: checkpoint_dir /c is full")
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), {"n0": rep(0, G.FAILED), "n1": fatal}, [node(0), node(1)], now=10)
    assert d.action is Action.FAIL and d.reason == "generation 1: rank 1 on node n1 cannot go on: checkpoint_dir /c is full"
    assert d.node_failures is None and d.quarantined_until is None


def test_ranks_that_resumed_from_different_steps_fail_the_job_loudly() -> None:
    reps = {"n0": dataclasses.replace(rep(0, G.RUNNING), resumed_steps={"0": 20, "1": 20}),
            "n1": dataclasses.replace(rep(1, G.RUNNING), resumed_steps={"2": 10, "3": 20})}
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), reps, [node(0), node(1)], now=10)
    assert d.action is Action.FAIL and "rank(s) 2 from step 10; rank(s) 0, 1, 3 from step 20" in d.reason, d.reason
    reps["n1"] = dataclasses.replace(rep(1, G.RUNNING), resumed_steps={"2": 20, "3": 20})
    assert decide(SPEC, J.RUNNING, plan_on(0, 1), reps, [node(0), node(1)], now=10).action is Action.NOTHING


def test_the_steps_in_order_and_each_one_alone() -> None:
    from mselastic.core import planner

    assert [f.__name__ for f in planner.STEPS] == ["first_launch", "launch_error", "cannot_go_on", "mixed_resume",
                                                   "elasticd_restart", "relaunch_after_fault", "success", "restart",
                                                   "scale_down", "drain", "refused_for_good", "scale_up"]

    def situation(plan: Plan | None, reports: list[GenerationReport], nodes: list[NodeRecord],
                  status: JobStatus | None = None) -> planner.Situation:
        st_ = status or st()
        return planner.Situation(SPEC, plan, st_, nodes, planner.eligible(nodes, SPEC), {}, reports, PortRange(), 0,
                                 10.0, "")
    healthy = situation(plan_on(0), [rep(0, G.RUNNING)], [node(0)])
    assert [step.__name__ for step in planner.STEPS if step(healthy) is not None] == ["scale_up"]
    assert planner.scale_up(healthy).action is Action.NOTHING
    # Each step on the situation it is for, and only that one.
    cases = {
        "first_launch": situation(None, [], [node(0)]),
        "refused_for_good": dataclasses.replace(situation(plan_on(0, 1), [rep(0, G.RUNNING)], [node(0), node(1)]),
                                                refused={"n1": (20.0, "no uid")}, refused_fail_s=15.0),
        "launch_error": situation(plan_on(0), [dataclasses.replace(rep(0, G.FAILED), cause=FailureCause.LAUNCH_SPEC)],
                                  [node(0)]),
        "cannot_go_on": situation(plan_on(0, 1), [rep(0, G.FAILED), dataclasses.replace(
            rep(1, G.FAILED), cause=FailureCause.TRAINER_FATAL)], [node(0), node(1)]),
        "mixed_resume": situation(plan_on(0, 1), [dataclasses.replace(rep(0, G.RUNNING), resumed_steps={"0": 20}),
                                                  dataclasses.replace(rep(1, G.RUNNING), resumed_steps={"1": 10})],
                                  [node(0), node(1)]),
        "relaunch_after_fault": situation(plan_on(0, 1), [rep(1, G.FAILED)], [node(0), node(1)]),
        "success": situation(plan_on(0), [rep(0, G.SUCCEEDED)], [node(0)]),
        "restart": situation(plan_on(0), [rep(0, G.RUNNING)], [node(0)], st(restart_requested=1)),
        "scale_down": situation(plan_on(0, 1, 2), [], [node(0), node(1), node(2)]),
        "drain": situation(plan_on(0, 1), [], [node(0), dataclasses.replace(node(1), draining=True, cordoned=True)]),
    }
    for name, s in cases.items():
        first = next(step for step in planner.STEPS if step(s) is not None)
        assert first.__name__ == name, (name, first.__name__)


def shut_down(i: int, cause: FailureCause = FailureCause.AGENT_SHUTDOWN) -> GenerationReport:
    """Node n<i>'s report once its elasticd stopped its ranks at step 40 (SIGTERM to elasticd, or
    with SIGTERM: its ranks stopped at the step another node's elasticd named)."""
    return dataclasses.replace(rep(i, G.STOPPED), cause=cause, exit_step=40, reason="checkpointed at step 40")


def test_a_restarted_elasticd_is_a_planned_relaunch_counted_neither_as_a_restart_nor_against_the_node() -> None:
    # One node: back and registered, its report says it was stopped on request.
    d = decide(SPEC, J.RUNNING, plan_on(0, restarts=1), {"n0": shut_down(0)}, [node(0)], now=10)
    assert d.action is Action.LAUNCH and d.plan is not None and d.plan.planned, d.reason
    assert d.plan.restart_count == 1 and d.plan.kind == "elasticd_restart"
    assert d.node_failures is None and d.quarantined_until is None and d.fault is None
    assert d.reason == "planned: elasticd stopped on request on n0"
    # Two nodes, n1's elasticd restarting (gone for now), n0's ranks stopped at the same step: wait, blaming nobody.
    d = decide(SPEC, J.RUNNING, plan_on(0, 1), {"n0": shut_down(0, FailureCause.SIGTERM), "n1": shut_down(1)},
               [node(0)], now=10, status=st(J.RUNNING))
    assert d.action is Action.LAUNCH and d.plan is not None and [m.node_id for m in d.plan.members] == ["n0"], d.reason
    assert d.plan.restart_count == 0 and d.node_failures is None
    big = dataclasses.replace(SPEC, min_nodes=2)
    d = decide(big, J.RUNNING, plan_on(0, 1, spec=big), {"n0": shut_down(0, FailureCause.SIGTERM), "n1": shut_down(1)},
               [node(0)], now=10, status=st(J.RUNNING))
    assert d.action is Action.WAIT and d.node_failures is None, d.reason


@pytest.mark.parametrize("case, members, reports, nodes", [
    ("a crash (its successor closed the report)", (0,),
     {"n0": dataclasses.replace(rep(0, G.FAILED), cause=FailureCause.AGENT_RESTARTED)}, [0]),
    ("a rank's own SIGTERM, no elasticd stopped", (0,), {"n0": shut_down(0, FailureCause.SIGTERM)}, [0]),
    ("a stopped elasticd beside a failed rank", (0, 1), {"n0": shut_down(0), "n1": rep(1, G.FAILED, rank=2)}, [0, 1]),
    ("a stopped elasticd beside a node lost without a word", (0, 1), {"n0": shut_down(0)}, [0]),
])
def test_anything_but_a_stopped_elasticd_is_still_a_fault(case: str, members: tuple[int, ...],
                                                          reports: dict[str, GenerationReport],
                                                          nodes: list[int]) -> None:
    d = decide(SPEC, J.RUNNING, plan_on(*members), reports, [node(i) for i in nodes], now=10)
    assert d.kind != "elasticd_restart" and d.node_failures, (case, d)


def test_a_member_refusing_the_pushes_for_good_fails_the_job_in_the_planner() -> None:
    """#48: the decision is the planner's, not the applier's: a member whose agent has refused the
    current plan's pushes (a setting it lacks) for refused_fail_s, without a report on it, fails
    the job, naming the node and why; sooner, or once it reported, nothing is decided on it."""
    plan, running = plan_on(0, 1), {"n0": rep(0, G.RUNNING)}
    nodes = [node(0), node(1)]
    d = decide(SPEC, J.RUNNING, plan, running, nodes, refused={"n1": (20.0, "no uid")}, refused_fail_s=15.0)
    assert d.action is Action.FAIL and "node n1 refused generation 1 for 20 s (no uid)" in d.reason, d
    assert d.fault is None and d.node_failures is None  # (no node blamed)
    d = decide(SPEC, J.RUNNING, plan, running, nodes, refused={"n1": (10.0, "no uid")}, refused_fail_s=15.0)
    assert d.action is Action.NOTHING, d
    both = {**running, "n1": rep(1, G.RUNNING)}
    assert decide(SPEC, J.RUNNING, plan, both, nodes, refused={"n1": (20.0, "x")}, refused_fail_s=15.0).action \
        is Action.NOTHING
