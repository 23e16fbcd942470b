"""Applying one job's decision: a plan committed with its status and event in one transaction
under the leader key and pushed to the agents (the members it drops stopped at the plan's step),
a status written, and what was missed repaired: pushes a member did not report on, Stops that were
lost, members whose agent refuses the pushes for good."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Protocol

from mselastic import metrics
from mselastic.core.kinds import EventKind, RelaunchReason
from mselastic.core.model import Event, FailureRecord, Plan
from mselastic.core.planner import Blame, Decision, Fail, Launch, Nothing, Succeed, Wait
from mselastic.core.states import FailureCause, JobState
from mselastic.daemon.agents import Agents
from mselastic.daemon.history import History
from mselastic.daemon.memo import PRUNE_EVERY_S, JobMemo
from mselastic.daemon.presence import Presence
from mselastic.daemon.statuses import Statuses
from mselastic.store.etcd import PermanentError, Store, TemporaryError
from mselastic.store.lease import Term
from mselastic.store.views import JobView

log = logging.getLogger(__name__)

#: How long after a job ended the members of its current plan that have not reported on it are
#: stopped too (their Launch may be on the wire); later, only what the reports say still runs.
FRESH_END_S = 60.0


class Limits(Protocol):
    """What the applier needs of the leader's settings (``CoordinatorConfig`` has them: see there)."""

    @property
    def repush_after_s(self) -> float: ...

    @property
    def denied_push_fail_s(self) -> float: ...

    @property
    def keep_report_generations(self) -> int: ...


class Applier:
    """The leader's hands for one job's decision at a time (a job's worker in the work queue)."""

    def __init__(self, store: Store, cfg: Limits, agents: Agents, statuses: Statuses, history: History,
                 presence: Presence, memo: Callable[[str], JobMemo], not_inflight: Callable[[str], None]) -> None:
        self.store, self.cfg, self.agents, self.statuses = store, cfg, agents, statuses
        self.history, self.presence, self._memo, self._not_inflight = history, presence, memo, not_inflight

    async def apply(self, term: Term, view: JobView, d: Decision | None, slot_wait: bool = False) -> None:
        """Apply ``d`` (None: the spec is unreadable) to the job as ``view`` read it; then prune its
        events when due."""
        try:
            await self._apply_decision(term, view, d, slot_wait)
        finally:  # after the decision: housekeeping never holds a job's decision back
            memo = self._memo(view.name)
            if time.monotonic() - memo.pruned_at >= PRUNE_EVERY_S:
                memo.pruned_at = time.monotonic()
                try:
                    await self.history.prune_events(term, view.name)
                except (TemporaryError, PermanentError) as e:
                    log.warning("events not pruned: %s", e, extra=dict(job=view.name))

    async def _apply_decision(self, term: Term, view: JobView, d: Decision | None, slot_wait: bool) -> None:
        if d is None:
            if not view.status.state.terminal:
                await self.statuses.set(term, view, JobState.FAILED, f"spec unreadable: {view.spec_error}")
            await self._restop(view, grace_s=view.status.stop_grace_s or 10.0)
            return
        assert view.spec is not None
        if view.status.state.terminal:
            await self.history.note_recovery(term, view)  # a job may end before its recovery was recorded
            await self.history.note_stopped_at(term, view)
            await self._restop(view, view.status.stop_grace_s or view.spec.stop_grace_period_s)
            return
        if isinstance(d, Launch):
            if d.plan.planned and view.plan is not None:
                # The step the running generation stops at goes in the plan: the members that go on
                # read it from their Launch, the dropped ones from their Stop; all the ranks stop there.
                at = await self.agents.stop_step(view.name, view.plan.generation,
                                                 {m.node_id: m.agent_address for m in view.plan.members})
                d = dataclasses.replace(d, plan=dataclasses.replace(d.plan, stop_previous_at_step=at))
            await self._commit_plan(term, view, d)
        elif isinstance(d, Succeed):
            await self.statuses.set(term, view, JobState.SUCCEEDED, d.reason)
        elif isinstance(d, Fail):
            if await self.statuses.set(term, view, JobState.FAILED, d.reason, failure=self._failure(view, d.blame),
                                      decision=d) and view.plan is not None:
                # After a fault (restarts exhausted) the collective is broken, as at a relaunch: the
                # ranks left could not reach a step to checkpoint at, and a grace period would only
                # hold the node's slots (a job waiting for them) for nothing. Killed at once.
                grace = 0.0 if d.fault is not None or d.lost_nodes else view.spec.stop_grace_period_s
                await self.agents.stop(view.name, view.plan.generation, grace,
                                       {m.node_id: m.agent_address for m in view.plan.members}, final=True)
        elif isinstance(d, Wait):
            # A wait for slots other jobs hold is a queue, not a shortage of nodes: not timed.
            state = JobState.PENDING if view.plan is None else JobState.RESTARTING
            since = 0.0 if slot_wait else (view.status.waiting_since or time.time())
            if (view.status.state, view.status.message, bool(view.status.waiting_since)) != (
                    state, d.reason, bool(since)):
                await self.statuses.set(term, view, state, d.reason, failure=self._failure(view, d.blame),
                                       waiting_since=since, decision=d)
        else:
            await self.history.note_recovery(term, view)
            await self._note(term, view, d)
            await self.history.note_progress(term, view)
            await self._repush(term, view)

    async def _note(self, term: Term, view: JobView, d: Nothing) -> None:
        """Keep the status's note (pending scale-up, idle nodes, a waiting drain) current."""
        old = view.status
        if view.plan is None or old.state.terminal or (old.note, old.scale_up_nodes, old.scale_up_since) == (
                d.note, d.scale_up_nodes, d.scale_up_since):
            return
        status = dataclasses.replace(self.statuses.compose(view, old.state, old.message, old.last_failure),
                                     note=d.note, scale_up_nodes=d.scale_up_nodes, scale_up_since=d.scale_up_since)
        event = Event(at=time.time(), kind=EventKind.NOTE, generation=view.plan.generation, message=d.note or "note cleared")
        await self.statuses.write(term, view, status, event if d.note != old.note else None)

    def _failure(self, view: JobView, b: Blame) -> FailureRecord | None:
        if view.plan is None or (b.fault is None and not b.lost_nodes):
            return view.status.last_failure
        if b.fault is not None:
            return FailureRecord(generation=view.plan.generation, node_id=b.fault.node_id, rank=b.fault.failed_rank,
                                 reason=b.fault.reason, detected_at=b.fault.detected_at, cause=b.fault.cause)
        return FailureRecord(generation=view.plan.generation, node_id=",".join(b.lost_nodes), rank=-1,
                             reason="node lost (lease expired)", detected_at=time.time(), cause=FailureCause.NODE_LOST)

    async def _commit_plan(self, term: Term, view: JobView, d: Launch) -> None:
        assert view.spec is not None
        k, tx = self.store.keys, self.store.tx
        failure = self._failure(view, d.blame)
        status = self.statuses.compose(view, JobState.RUNNING, d.reason, failure, d.plan, decision=d)
        self.statuses.wrote(status)
        # Why each lost member may be replaced (the fencing rule that let this leader go on without it).
        fenced = "".join(f"; {n}: {v.reason}" for n in d.lost_nodes
                         if (v := self.presence.verdict(n)) is not None and v.act)
        event = Event(at=time.time(), kind=EventKind.PLANNED if d.plan.planned else EventKind.GENERATION, generation=d.plan.generation,
                      message=f"generation {d.plan.generation} on {', '.join(m.node_id for m in d.plan.members)}"
                              f" (world size {d.plan.world_size}, master port {d.plan.master_port}): {d.reason}{fenced}",
                      node_id=d.fault.node_id if d.fault else "", rank=d.fault.failed_rank if d.fault else -1,
                      detected_at=failure.detected_at if failure and (d.fault or d.lost_nodes) else 0.0)
        plan_key = k.plan(view.name).encode()
        compare = [term.guard(self.store),
                   tx.mod(plan_key) == (view.plan_kv.mod_revision if view.plan_kv else 0),
                   self.statuses.unchanged(view)]
        # A pass reads two generations' reports, a restarting elasticd all of them: keep the newest few.
        old_reports = (k.reports(view.name, 0), k.reports(view.name, max(d.plan.generation - self.cfg.keep_report_generations, 0)))
        ok = await self.store.txn(compare, [
            tx.put(plan_key, d.plan.to_json().encode()),
            tx.put(k.plan_history(view.name, d.plan.generation).encode(), d.plan.to_json().encode()),
            tx.put(k.status(view.name).encode(), status.to_json().encode()),
            tx.put(k.event(view.name, time.time_ns()).encode(), event.to_json().encode()),
            tx.delete(old_reports[0].encode(), old_reports[1].encode()),
        ])
        if not ok:
            self._not_inflight(view.name)
            await self.statuses.check_leader(term)
            # The watch brings the change that made the compare fail, and with it the next pass.
            log.info("plan or status changed under us (a stop, a restart, another pass); the next pass decides "
                     "again", extra=dict(job=view.name, generation=d.plan.generation))
            return
        log.info("committed generation %d: %s", d.plan.generation, d.reason,
                 extra=dict(job=view.name, generation=d.plan.generation))
        if failure is not None and (d.fault or d.lost_nodes):
            self._memo(view.name).relaunched[d.plan.generation] = time.monotonic()
        metrics.GENERATIONS.labels(view.name).inc()
        if view.plan is not None:
            metrics.RESTARTS.labels(view.name, (d.kind or RelaunchReason.INITIAL).value).inc()
        # Planned: every rank of the running generation is asked (SIGTERM) to checkpoint at the plan's
        # stop step, so the members being dropped and the ones relaunched are told at the same time.
        # After a fault there is nothing to save: kill at once.
        grace = view.spec.stop_grace_period_s if d.plan.planned else 0.0
        dropped = {m.node_id: m.agent_address for m in (view.plan.members if view.plan else ())
                   if d.plan.member(m.node_id) is None}
        self._mark_pushed(d.plan)
        stops = self.agents.stop(view.name, view.plan.generation, grace, dropped, d.plan.stop_previous_at_step) \
            if view.plan and dropped else None
        launch = asyncio.ensure_future(self.agents.launch(d.plan, extra_timeout_s=grace))
        await asyncio.gather(launch, *([stops] if stops else []))
        self._note_denials(d.plan, launch.result())

    async def _repush(self, term: Term, view: JobView) -> None:
        """Push the committed plan again to members that have not reported on it (missed push).
        (A member whose agent refuses it for good fails the job: the planner's refused_for_good,
        from what :meth:`refusals` says.)"""
        plan = view.plan
        if plan is None or view.status.state.terminal or view.spec is None:
            return
        reports = view.current_reports()
        now = time.monotonic()
        memo = self._memo(view.name)
        missing = [m for m in plan.members if m.node_id not in reports
                   and now - memo.pushed.get((plan.generation, m.node_id), 0) > self.cfg.repush_after_s]
        if missing:
            self._mark_pushed(plan, {m.node_id for m in missing})
            self._note_denials(plan, await self.agents.launch(plan, only={m.node_id for m in missing}))

    def refusals(self, view: JobView) -> dict[str, tuple[float, str]]:
        """Members of the job's current plan whose agent refuses its pushes for good: node id ->
        (for how long, why), as the pushes answered (the planner's input)."""
        if view.plan is None:
            return {}
        now, generation = time.monotonic(), view.plan.generation
        return {node_id: (now - since, why) for (g, node_id), (since, why) in self._memo(view.name).denied.items()
                if g == generation and why}

    def _note_denials(self, plan: Plan, answers: dict[str, str]) -> None:
        """Remember since when each member's agent refuses the pushes for good (see ``_repush``)."""
        now, memo = time.monotonic(), self._memo(plan.job)
        memo.denied = {k: v for k, v in memo.denied.items() if k[0] == plan.generation}
        for node_id, why in answers.items():
            key = (plan.generation, node_id)
            if not why:
                memo.denied.pop(key, None)
            elif key not in memo.denied:
                memo.denied[key] = (now, why)

    async def _restop(self, view: JobView, grace_s: float) -> None:
        """A job that is over (an operator's stop records only that: Control.StopJob) but whose
        generation still starts, runs or stops somewhere (by the reports), or whose current plan's
        member has not reported yet (its Launch may be on the wire) just after it ended: stop it
        there, and again at most every ``repush_after_s`` while its report says it is not over (the
        Stop was lost: an agent unreachable for a moment)."""
        now, restopped = time.monotonic(), self._memo(view.name).restopped
        reports = dict(view.reports)
        fresh = view.plan is not None and time.time() - view.status.updated_at < FRESH_END_S
        if fresh and view.plan is not None:
            reports.setdefault(view.plan.generation, {})
        for generation, reps in sorted(reports.items()):
            nodes, again = {}, []
            members = view.plan.members if fresh and view.plan is not None and generation == view.plan.generation \
                else ()
            unreported = [m.node_id for m in members if m.node_id not in reps]
            for node_id in [*reps, *unreported]:
                rep = reps.get(node_id)
                member = view.plan.member(node_id) if view.plan else None
                key = (generation, node_id)
                if (rep is not None and rep.state.terminal) or member is None or (rep is None and key in restopped) \
                        or now - restopped.get(key, -self.cfg.repush_after_s) < self.cfg.repush_after_s:
                    continue
                if key in restopped:
                    again.append(node_id)
                restopped[key] = now
                nodes[node_id] = member.agent_address
            if nodes:
                ctx = dict(job=view.name, generation=generation)
                if again:
                    log.warning("stopping generation %d again on %s: the job is %s", generation,
                                ", ".join(sorted(again)), view.status.state.value, extra=ctx)
                if set(nodes) - set(again):
                    log.info("stopping generation %d on %s: the job is %s", generation,
                             ", ".join(sorted(set(nodes) - set(again))), view.status.state.value, extra=ctx)
                await self.agents.stop(view.name, generation, grace_s, nodes, final=True)

    def _mark_pushed(self, plan: Plan, only: set[str] | None = None) -> None:
        now, pushed = time.monotonic(), self._memo(plan.job).pushed
        for m in plan.members:
            if only is None or m.node_id in only:
                pushed[(plan.generation, m.node_id)] = now
