"""What the leader records of each job's run beside its decisions: the step gauges and progress
events, how long a relaunch took to train again, where a planned relaunch resumed, the step a
stopped job checkpointed at; and the pruning of old events."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from mselastic import metrics
from mselastic.core.kinds import EventKind
from mselastic.core.model import Event, Plan
from mselastic.core.states import JobState
from mselastic.daemon.memo import JobMemo
from mselastic.daemon.statuses import Fenced, Statuses
from mselastic.store.etcd import Store
from mselastic.store.lease import Term
from mselastic.store.views import JobView

log = logging.getLogger(__name__)

#: Appended once to a stopped job's status message when its ranks have left (the guard against
#: appending it again, whichever way they left).
STOPPED_NOTE = "; the ranks "


@dataclasses.dataclass(frozen=True)
class Keep:
    """How much history is written and kept."""

    #: Record each running job's step in its events this often (0: never).
    progress_interval_s: float = 10.0
    #: Events kept per job: the oldest are deleted once there are more, and any older than ``events_s``.
    events: int = 2000
    events_s: float = 30 * 24 * 3600.0


class History:
    def __init__(self, store: Store, keep: Keep, statuses: Statuses, memo: Callable[[str], JobMemo]) -> None:
        self.store, self.keep, self.statuses, self._memo = store, keep, statuses, memo

    def note_first_step(self, view: JobView, mono: float) -> None:
        """When a pass first saw a first step of a generation this leader relaunched (monotonic)."""
        memo, g = self._memo(view.name), view.plan.generation if view.plan else -1
        if g in memo.relaunched and g not in memo.first_step and any(
                r.first_step_at for r in view.current_reports().values()):
            memo.first_step[g] = mono

    async def note_progress(self, term: Term, view: JobView) -> None:
        """Job gauges on every pass; a ``progress`` event every ``progress_interval_s`` (for reports)."""
        plan, step = view.plan, view.step
        if plan is None or view.status.state.terminal:
            return
        if step < 0:  # a generation starting (no step yet): no steps a second, until it steps
            metrics.STEP_RATE.labels(view.name).set(0)
            return
        now = time.monotonic()  # durations only; the event's time is the wall clock
        metrics.STEP.labels(view.name).set(step)
        metrics.WORLD_SIZE.labels(view.name).set(plan.world_size)
        metrics.GENERATION.labels(view.name).set(plan.generation)
        memo = self._memo(view.name)
        since, from_step = memo.rate
        if step < from_step or now - since > 30:
            if step == from_step:  # no step for 30 s: say so (an alert on a rate of 0 while RUNNING)
                metrics.STEP_RATE.labels(view.name).set(0)
            memo.rate = (now, step)
        elif now - since >= 3 and step > from_step:
            metrics.STEP_RATE.labels(view.name).set((step - from_step) / (now - since))
            memo.rate = (now, step)
        last_at, last_step = memo.progress
        interval = self.keep.progress_interval_s
        if interval and step != last_step and now - last_at >= interval:
            memo.progress = (now, step)
            k, tx = self.store.keys, self.store.tx
            event = Event(at=time.time(), kind=EventKind.PROGRESS, generation=plan.generation, message=f"step {step}",
                          step=step, world_size=plan.world_size, loss=view.loss)
            if not await self.store.txn([term.guard(self.store)],
                                        [tx.put(k.event(view.name, time.time_ns()).encode(), event.to_json().encode())]):
                raise Fenced()
            memo.progress_events = n = memo.progress_events + 1
            if n % 100 == 1:
                await self.prune_events(term, view.name)

    async def prune_events(self, term: Term, job: str) -> int:
        """Delete the job's events beyond the newest ``keep.events`` and those older than
        ``keep.events_s`` (event keys are their write time in ns, so both are one key range: one
        keys-only read, one range delete); returns how many were deleted."""
        k, tx = self.store.keys, self.store.tx
        keys = await self.store.keys_under(k.events(job))
        # Event keys are write times in ns: 19 digits since 2001, so they sort as numbers. The cut
        # must have 19 digits too, or a long keep_events_s would sort above every key.
        too_old = k.event(job, max(time.time_ns() - int(self.keep.events_s * 1e9), 10**18))
        cut = max(keys[len(keys) - self.keep.events] if len(keys) > self.keep.events else "", too_old)
        gone = sum(1 for key in keys if key < cut)
        if not gone:
            return 0
        if not await self.store.txn([term.guard(self.store)],
                                    [tx.delete(k.events(job).encode(), cut.encode())]):
            raise Fenced()
        log.info("pruned %d old events", gone, extra=dict(job=job))
        return gone

    async def note_recovery(self, term: Term, view: JobView) -> None:
        """Once the new generation's first step is reported, record the recovery time
        (or, after a planned relaunch, where it resumed against where the last one stopped)."""
        f, plan = view.status.last_failure, view.plan
        if plan is not None and plan.planned and view.status.resumed_through < plan.generation:
            await self._note_planned_resume(term, view, plan)
            return
        if f is None or plan is None or f.recover_s or f.generation >= plan.generation:
            return
        reports = view.current_reports().values()
        memo, g = self._memo(view.name), plan.generation
        if g not in memo.relaunched or g not in memo.first_step:
            return  # (committed by another leader: its clock is not ours to subtract from)
        # One clock: from this leader's commit of the relaunch to its first sight of a first step
        # (the agents' detection and teardown before it are the detection metric's).
        recover_s = max(0.001, round(memo.first_step.pop(g) - memo.relaunched.pop(g), 3))
        recovered = dataclasses.replace(f, recover_s=recover_s)
        metrics.RECOVERY.labels(view.name).observe(recovered.recover_s)
        resumed = max((r.resumed_step for r in reports), default=-1)
        notes = sorted({r.resume_note for r in reports if r.resume_note})
        await self.statuses.set(term, view, view.status.state, view.status.message, failure=recovered,
                                event=Event(at=time.time(), kind=EventKind.RECOVERED, generation=plan.generation,
                                            message=f"generation {plan.generation} resumed from step {resumed}, "
                                                    f"first step {recovered.recover_s:.2f}s after the relaunch was "
                                                    f"committed" + "".join(f"; {n}" for n in notes)))

    async def _note_planned_resume(self, term: Term, view: JobView, plan: Plan) -> None:
        reports = view.current_reports().values()
        firsts = [r.first_step_at for r in reports if r.first_step_at]
        if not firsts:
            return
        resumed = max((r.resumed_step for r in reports), default=-1)
        exits = sorted({r.exit_step for r in view.reports.get(plan.generation - 1, {}).values()})
        lost = f"{exits[-1] - resumed} step(s) recomputed" if exits and exits[-1] >= 0 else "previous ranks were killed"
        status = dataclasses.replace(view.status, resumed_through=plan.generation, updated_at=time.time())
        await self.statuses.write(term, view, status, Event(
            at=time.time(), kind=EventKind.RESUMED, generation=plan.generation,
            message=f"generation {plan.generation} resumed from step {resumed}; generation {plan.generation - 1} "
                    f"checkpointed at step(s) {exits} on request; {lost}"))

    async def note_stopped_at(self, term: Term, view: JobView) -> None:
        """Once the ranks of a stopped job have left, say at which step they checkpointed (the step
        a resubmission resumes from), in the status and as an event; once."""
        reports = view.current_reports().values()
        if (view.status.state is not JobState.STOPPED or view.plan is None or STOPPED_NOTE in view.status.message
                or len(reports) < len(view.plan.members) or not all(r.state.terminal for r in reports)):
            return
        exits = {r.exit_step for r in reports}
        message = (f"{view.status.message}{STOPPED_NOTE}checkpointed at step {exits.pop()} and exited"
                   if len(exits) == 1 and -1 not in exits else f"{view.status.message}{STOPPED_NOTE}were killed "
                   f"before they checkpointed (a resubmission resumes from the last interval checkpoint)")
        await self.statuses.set(term, view, JobState.STOPPED, message, event=Event(
            at=time.time(), kind=EventKind.STOPPED, generation=view.plan.generation, message=message))
