"""next_status as a table: what each kind of write keeps, resets and refuses. No etcd."""

from __future__ import annotations

import pytest

from mselastic.core.model import FailureRecord, JobStatus, NodeRecord
from mselastic.core.planner import Blame, Launch, PortRange, Wait, make_plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import IllegalTransition, JobState
from mselastic.core.status import next_status

SPEC = JobSpec(name="job", script="/s.py", checkpoint_dir="/c", workers_per_node=1, max_nodes=2)
NODES = [NodeRecord(node_id=f"n{i}", agent_address="a:1", host="h", slots=1, version="t") for i in range(2)]
PLAN3 = make_plan(SPEC, NODES, 3, 2, "t", None, PortRange())
FAIL = FailureRecord(generation=2, node_id="n1", rank=1, reason="boom", detected_at=5.0)
OLD = JobStatus(JobState.RUNNING, generation=2, restart_count=1, message="m", last_failure=FAIL, note="scale-up pending",
                node_failures={"n1": 1}, quarantined_until={"n1": 99.0}, failures_counted_through=2,
                scale_up_nodes=("n2",), scale_up_since=7.0, resumed_through=2, restart_requested=2)


def test_a_new_generation_takes_the_plan_and_the_decisions_blame_and_resets_the_note() -> None:
    d = Launch("r", PLAN3, blame=Blame(node_failures={"n1": 2}, quarantined_until={"n1": 120.0},
                                       failures_counted_through=3))
    s = next_status(OLD, JobState.RUNNING, "r", 10.0, plan=PLAN3, failure=FAIL, decision=d)
    assert (s.generation, s.restart_count, s.updated_at) == (3, 2, 10.0)
    assert s.node_failures == {"n1": 2} and s.quarantined_until == {"n1": 120.0} and s.failures_counted_through == 3
    assert (s.note, s.scale_up_nodes, s.scale_up_since) == ("", (), 0.0)
    assert s.restart_requested == 2 and s.resumed_through == 2  # only operators and recovery set these


def test_a_plain_write_keeps_the_note_and_the_counts() -> None:
    s = next_status(OLD, JobState.RUNNING, "recovered", 11.0, plan=None, failure=FAIL)
    assert (s.note, s.scale_up_nodes, s.scale_up_since) == (OLD.note, OLD.scale_up_nodes, OLD.scale_up_since)
    assert s.node_failures == OLD.node_failures and s.failures_counted_through == 2
    assert (s.generation, s.restart_count) == (2, 1)  # no plan given: kept


def test_a_waiting_job_without_a_plan_keeps_its_generation_floor() -> None:
    """A job submitted again after `delete` starts after the old generations (agents refuse older ones)."""
    submitted = JobStatus(JobState.PENDING, generation=3, message="submitted")
    s = next_status(submitted, JobState.PENDING, "waiting", 1.0, plan=None, failure=None, waiting_since=1.0,
                    decision=Wait("waiting"))
    assert s.generation == 3 and s.waiting_since == 1.0


@pytest.mark.parametrize("old, new", [(JobState.PENDING, JobState.RESTARTING), (JobState.STOPPED, JobState.RUNNING),
                                      (JobState.SUCCEEDED, JobState.FAILED), (JobState.FAILED, JobState.STOPPED)])
def test_illegal_transitions_are_refused(old: JobState, new: JobState) -> None:
    with pytest.raises(IllegalTransition):
        next_status(JobStatus(old), new, "x", 1.0, plan=None, failure=None)


def test_stop_from_every_live_state() -> None:
    for state in (JobState.PENDING, JobState.RUNNING, JobState.RESTARTING):
        s = next_status(JobStatus(state, generation=4), JobState.STOPPED, "stopped by operator", 2.0, plan=None,
                        failure=None)
        assert s.state is JobState.STOPPED and s.generation == 4 and s.waiting_since == 0.0
