"""Lifecycles of a job and of one generation on one node, with their legal transitions.

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


def check_job_transition(old: JobState, new: JobState) -> None:
    if new not in JOB_TRANSITIONS[old]:
        raise IllegalTransition(f"job state {old.value} -> {new.value} is not allowed")


def check_generation_transition(old: GenerationState, new: GenerationState) -> None:
    if new not in GENERATION_TRANSITIONS[old]:
        raise IllegalTransition(f"generation state {old.value} -> {new.value} is not allowed")

