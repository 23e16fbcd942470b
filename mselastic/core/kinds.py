"""The vocabulary of what happens to a job: why a generation was launched, and the kinds of
its events. Enums, so that code compares members and nothing is parsed back out of a message
text; their values are what etcd, the metrics' labels and ``elasticctl`` show.
"""

from __future__ import annotations

import enum


class RelaunchReason(str, enum.Enum):
    """Why a generation was committed (the plan's ``kind``; the ``reason`` label of
    ``mselastic_restarts``)."""

    INITIAL = "initial"
    RANK_FAILURE = "rank_failure"
    HANG = "hang"
    MSRUN_FAILURE = "msrun_failure"
    NODE_LOST = "node_lost"
    SIGTERM = "sigterm"
    LAUNCH_ERROR = "launch_error"
    DRAIN = "drain"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    RESTART = "restart"
    ELASTICD_RESTART = "elasticd_restart"  # a member's elasticd was stopped on request (planned)


class EventKind(str, enum.Enum):
    """A line of a job's timeline (``events/<job>/<seq>``, ``elasticctl events``)."""

    SUBMITTED = "submitted"
    GENERATION = "generation"  # a relaunch after a fault, or the first launch
    PLANNED = "planned"  # a planned relaunch (drain, scale, restart): nothing recomputed
    RECOVERED = "recovered"  # the first step after a fault's relaunch, with the recovery time
    RESUMED = "resumed"  # the first step after a planned relaunch, with where it resumed
    PROGRESS = "progress"  # the step reached (every progress_interval_s)
    NOTE = "note"  # what the job waits for or leaves out changed
    ERROR = "error"  # a reconcile pass of the job raised (retried with backoff)
    RESTART = "restart"  # elasticctl restart
    SCALED = "scaled"  # elasticctl scale
    STOPPED = "stopped"  # elasticctl stop
    # The job's state changed (written with the status): one per JobState that is not above.
    PENDING = "pending"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
