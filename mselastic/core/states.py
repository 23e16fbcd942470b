"""Lifecycles of a job, of one generation on one node, and of a node's registration, with their
legal transitions.

The names match the ``JobState`` / ``GenerationState`` enums of the wire contract
(``proto/mselastic/v1``) so conversion is by name. An illegal transition raises
instead of silently writing a state nobody planned for.
"""

from __future__ import annotations

import enum


class IllegalTransition(ValueError):
    """A state change that the lifecycle does not allow."""


class JobState(enum.Enum):
    PENDING = "PENDING"  # submitted, waiting for enough nodes
    RUNNING = "RUNNING"  # a generation is committed and launched
    RESTARTING = "RESTARTING"  # a generation failed; waiting for nodes to relaunch
    SUCCEEDED = "SUCCEEDED"  # every member finished its ranks cleanly
    FAILED = "FAILED"  # restarts exhausted or unrecoverable; nothing left running
    STOPPED = "STOPPED"  # stopped by an operator

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.STOPPED}),
    JobState.RUNNING: frozenset(
        {JobState.RUNNING, JobState.RESTARTING, JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}
    ),
    JobState.RESTARTING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.STOPPED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}


class GenerationState(enum.Enum):
    STARTING = "STARTING"  # msrun spawned, no rank has reported a step yet
    RUNNING = "RUNNING"  # at least one rank reported a heartbeat
    SUCCEEDED = "SUCCEEDED"  # every local rank finished and msrun exited 0
    FAILED = "FAILED"  # a rank died, hung, or msrun failed; torn down
    STOPPED = "STOPPED"  # stopped on request (new plan, job stop)

    @property
    def terminal(self) -> bool:
        return self in (GenerationState.SUCCEEDED, GenerationState.FAILED, GenerationState.STOPPED)


GENERATION_TRANSITIONS: dict[GenerationState, frozenset[GenerationState]] = {
    GenerationState.STARTING: frozenset(
        {GenerationState.RUNNING, GenerationState.SUCCEEDED, GenerationState.FAILED, GenerationState.STOPPED}
    ),
    GenerationState.RUNNING: frozenset(
        {GenerationState.SUCCEEDED, GenerationState.FAILED, GenerationState.STOPPED}
    ),
    GenerationState.SUCCEEDED: frozenset(),
    GenerationState.FAILED: frozenset(),
    GenerationState.STOPPED: frozenset(),
}


class NodeState(enum.Enum):
    """Where a node's registration stands, as its own agent sees it (``NodeAgent.run``; the
    fencing rules that move it are in :mod:`mselastic.core.fencing`)."""

    STARTING = "starting"  # elasticd started: adopting what an earlier one left, not registered
    REGISTERING = "registering"  # a lease granted or taken over by id; the node's key being written
    HOLDING = "holding"  # registered, its lease renewed
    UNREACHABLE = "unreachable"  # renewals do not get through: a fencing round every TTL/3 decides
    #: Its workers killed and its lease abandoned on a fencing rule: nothing is launched here until
    #: it is registered again (then HOLDING).
    FENCED = "fenced"
    #: Its lease expired with etcd (every node lost it), not fenced: registering again, keeping the
    #: generations etcd still has committed here.
    REREGISTERING = "re-registering"
    #: elasticd is going away: nothing new starts; generations left to their shims or stopped; the
    #: fencing rounds go on until the workers are gone.
    DRAINING = "draining"
    CLOSED = "closed"  # the registration released (or left to a successor) and every task ended


_REGISTERED = frozenset({NodeState.UNREACHABLE, NodeState.REGISTERING, NodeState.REREGISTERING, NodeState.FENCED,
                         NodeState.DRAINING})
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.STARTING: frozenset({NodeState.REGISTERING, NodeState.DRAINING}),
    NodeState.REGISTERING: frozenset({NodeState.HOLDING, NodeState.FENCED, NodeState.DRAINING}),
    NodeState.REREGISTERING: frozenset({NodeState.HOLDING, NodeState.FENCED, NodeState.DRAINING}),
    # (REGISTERING: its lease lost with nothing running here; REREGISTERING: with generations.)
    NodeState.HOLDING: _REGISTERED,
    NodeState.UNREACHABLE: _REGISTERED - {NodeState.UNREACHABLE} | {NodeState.HOLDING},
    # (HOLDING once registered again, the fence's kill over; a fence decided meanwhile stays.)
    NodeState.FENCED: frozenset({NodeState.HOLDING, NodeState.DRAINING}),
    NodeState.DRAINING: frozenset({NodeState.CLOSED}),
    NodeState.CLOSED: frozenset(),
}


class FailureCause(enum.Enum):
    """Why a generation ended badly on a node: set where it is seen, read by the planner and shown
    to operators, never parsed back out of a message text."""

    NONE = ""
    RANK_EXITED = "RANK_EXITED"  # a rank exited (or was killed) before finishing
    RANK_HUNG = "RANK_HUNG"  # no heartbeat for hang_timeout_s, or stopped (SIGSTOP, state T)
    RANK_NEVER_STARTED = "RANK_NEVER_STARTED"  # no first heartbeat within startup_timeout_s
    SIGTERM = "SIGTERM"  # the ranks checkpointed on a SIGTERM this agent did not send
    MSRUN_FAILED = "MSRUN_FAILED"  # msrun exited non-zero with every rank accounted for
    AGENT_RESTARTED = "AGENT_RESTARTED"  # a new elasticd closed what its predecessor left running
    SUPERVISOR_ERROR = "SUPERVISOR_ERROR"  # a bug in the agent's supervisor
    #: The generation could not be started because of the spec (checkpoint_dir not creatable,
    #: script missing): relaunching cannot help, the job fails with the reason.
    LAUNCH_SPEC = "LAUNCH_SPEC"
    #: ... because of the node (work_dir, msrun missing, master port busy): counts against the node.
    LAUNCH_NODE = "LAUNCH_NODE"
    NODE_LOST = "NODE_LOST"  # the node's registration expired (in a job's last failure, not in reports)
    #: A rank said it cannot go on (no checkpoint every rank can load, the checkpoint directory full):
    #: relaunching would meet the same, the job fails with the reason.
    TRAINER_FATAL = "TRAINER_FATAL"
    #: elasticd was stopped with its jobs (SIGINT, or a SIGTERM with a generation it could not leave
    #: to its shim) and stopped its ranks first,
    #: at a step they checkpointed at: a planned restart, no fault of the job or the node.
    AGENT_SHUTDOWN = "AGENT_SHUTDOWN"
    #: A rank failed and its log named its device (an uncorrectable ECC error, an Ascend UCE): the
    #: device is set aside on its node (issue #32), the node is not blamed.
    DEVICE = "DEVICE"


def check_job_transition(old: JobState, new: JobState) -> None:
    if new not in JOB_TRANSITIONS[old]:
        raise IllegalTransition(f"job state {old.value} -> {new.value} is not allowed")


def check_generation_transition(old: GenerationState, new: GenerationState) -> None:
    if new not in GENERATION_TRANSITIONS[old]:
        raise IllegalTransition(f"generation state {old.value} -> {new.value} is not allowed")



def check_node_transition(old: NodeState, new: NodeState) -> None:
    if new not in NODE_TRANSITIONS[old]:
        raise IllegalTransition(f"node state {old.value} -> {new.value} is not allowed")
