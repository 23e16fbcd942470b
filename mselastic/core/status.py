"""The job's next status, computed in one place.

Every status the coordinator writes (a new generation, a wait, a failure, success, a note) and
the one ``elasticctl stop`` writes come from :func:`next_status`: a pure function of the status
as read, the state and message to move to, the plan it is about and the planner's decision, so
the rules (what a decision resets, what a plain write keeps, which transitions are legal) are
table-tested without etcd.
"""

from __future__ import annotations

from mselastic.core.model import FailureRecord, JobStatus, Plan
from mselastic.core.planner import Blame, Decision, Nothing, blame_of
from mselastic.core.states import JobState, check_job_transition


def next_status(old: JobStatus, state: JobState, message: str, now: float, *, plan: Plan | None,
                failure: FailureRecord | None, waiting_since: float = 0.0,
                decision: Decision | None = None) -> JobStatus:
    """The status after ``old`` moves to ``state`` (raises IllegalTransition when it may not).

    ``plan``: the job's plan after the write (its generation and restart count are shown).
    Node failure counts and quarantine come from ``decision`` when it blamed a node, else
    they are kept. A decision sets the note (what the job waits for, a pending scale-up); a
    plain write keeps it. ``waiting_since`` is 0 unless the job waits. What only operators
    set (a requested restart) and what only the recovery bookkeeping sets (the newest
    planned resume recorded) are kept. Quarantines over by ``now`` are dropped.
    """
    if state is not old.state:
        check_job_transition(old.state, state)
    blame = blame_of(decision) if decision is not None else Blame()
    failures = blame.node_failures if blame.node_failures is not None else old.node_failures
    quarantine = blame.quarantined_until if blame.quarantined_until is not None else old.quarantined_until
    counted = max(old.failures_counted_through, blame.failures_counted_through)
    if decision is None:
        note = (old.note, old.scale_up_nodes, old.scale_up_since)
    elif isinstance(decision, Nothing):
        note = (decision.note, decision.scale_up_nodes, decision.scale_up_since)
    else:
        note = ("", (), 0.0)
    return JobStatus(state=state, generation=plan.generation if plan else old.generation,
                     restart_count=plan.restart_count if plan else old.restart_count, message=message,
                     last_failure=failure, updated_at=now, waiting_since=waiting_since,
                     node_failures=dict(failures), quarantined_until={n: t for n, t in quarantine.items() if t > now},
                     failures_counted_through=counted, note=note[0], scale_up_nodes=note[1],
                     scale_up_since=note[2], resumed_through=old.resumed_through,
                     restart_requested=old.restart_requested,
                     stop_grace_s=old.stop_grace_s if state is JobState.STOPPED else 0.0)
