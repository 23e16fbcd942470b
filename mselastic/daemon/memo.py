"""What the leader keeps about one job between passes (:class:`JobMemo`): forgetting a job is one
delete."""

from __future__ import annotations

import dataclasses

#: Every job's events are pruned to ``keep_events`` when a term of this leader first sees the job
#: and then this often (and every 100 progress events), whatever wrote them.
PRUNE_EVERY_S = 300.0


@dataclasses.dataclass
class JobMemo:
    """Times are this leader's monotonic clock; (generation, node id) keys name a member."""

    #: (time, step) of the last progress event written, and the one the step rate is measured from.
    progress: tuple[float, int] = (0.0, -1)
    rate: tuple[float, int] = (0.0, -1)
    #: Progress events written by this leader (events are pruned every 100).
    progress_events: int = 0
    #: When its events were last pruned.
    pruned_at: float = -PRUNE_EVERY_S
    #: When the plan was last pushed to a member, and a Stop sent again (see Coordinator._restop).
    pushed: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    restopped: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    #: Members whose agent refuses the pushes for good: since when, and why.
    denied: dict[tuple[int, str], tuple[float, str]] = dataclasses.field(default_factory=dict)
    # For one term (see Statuses.on_my_clock and History.note_recovery):
    #: Another writer's times in its status, (what, stamp) -> the same on this leader's clock.
    anchors: dict[tuple[str, float], float] = dataclasses.field(default_factory=dict)
    #: generation -> when this leader committed it to recover from a fault, and when a pass first
    #: saw a first step of it (a job's task may be busy then).
    relaunched: dict[int, float] = dataclasses.field(default_factory=dict)
    first_step: dict[int, float] = dataclasses.field(default_factory=dict)

    def new_term(self) -> None:
        # (A prune cut short by the end of the last term, deposed mid-way, is done again at once.)
        self.pruned_at = -PRUNE_EVERY_S
        self.anchors.clear()
        self.relaunched.clear()
        self.first_step.clear()
