"""The coordinator: every elasticd campaigns; the leader runs the reconcile loop.

Level-triggered: a pass reads the whole state from etcd and asks the planner what
to do for each job, in submission order (slots are shared: a job is placed only on
slots no other job holds, first come, first served). Each job's decision is then
applied by a task of its own, as a controller's work queue does: one job's slow push
or exception never delays or stops another, a job is handled by one task at a time,
and a job whose pass raised is retried with backoff, the error shown on the job.
A pass reads no etcd: the leader keeps an :class:`~mselastic.store.informer.Informer`
(list, then watch, re-list when the watch breaks), and a change it applies wakes the
loop. Passes also run at least every ``reconcile_interval_s``, so a missed push is
repaired by the next pass.

Every write of a plan or a job status is one transaction that checks that this
process still holds the leader key (its create revision is the fencing token) and
that the job's status (and, for plans, the stored plan) is still the one the
decision was made on: a ``stop`` or ``restart`` written by the Control service
meanwhile makes the write fail, and the next pass decides again from what is stored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from typing import Awaitable

from mselastic import metrics
from mselastic.core import fencing
from mselastic.core.waits import first
from mselastic.core.model import CordonRecord, Event, FailureRecord, JobStatus, LeaderRecord, Plan
from mselastic.core.kinds import EventKind, RelaunchReason
from mselastic.core.model import MalformedRecord
from mselastic.core.planner import MAX_QUARANTINE_S, Action, Decision, PortRange, decide
from mselastic.core.states import FailureCause, JobState
from mselastic.core.status import next_status
from mselastic.store.etcd import PermanentError, Store, TemporaryError
from mselastic.store.informer import Informer
from mselastic.store.lease import Election, Term
from mselastic.store.views import ClusterView, JobView, read_cluster
from mselastic.daemon.agents import Agents
from mselastic.daemon.presence import Presence
from mselastic.tls import TlsFiles

log = logging.getLogger(__name__)


#: Appended once to a stopped job's status message when its ranks have left (the guard against
#: appending it again, whichever way they left).
STOPPED_NOTE = "; the ranks "

#: Every job's events are pruned to ``keep_events`` when this leader first sees the job and then
#: this often (and every 100 progress events), whatever wrote them.
PRUNE_EVERY_S = 300.0

#: After a pass, the loop rests this many times the pass's duration before the next one: passes
#: use at most a third of a core however fast changes come (at 4,000 nodes reporting every second
#: they would otherwise run back to back), and a small cluster's pass of a few ms rests a few ms.
PASS_REST = 2.0
#: ... at most (a pass slowed by etcd retries must not hold the next one back for long).
MAX_REST_S = 1.0




class Fenced(Exception):
    """This process no longer holds the leader key; it must stop acting as leader."""


def requeue_delay_s(failures: int, base_s: float = 0.5, cap_s: float = 60.0) -> float:
    """Backoff before a job whose pass raised is handled again (client-go's per-item exponential
    rate limiter): ``base_s`` doubled per consecutive failure, at most ``cap_s``, with up to 10 %
    jitter so that several failing jobs do not retry in step."""
    delay = min(cap_s, base_s * 2 ** min(max(failures - 1, 0), 30))
    return delay * (1 + random.random() / 10)


def slots_held(cluster: ClusterView, inflight: dict[str, Plan]) -> dict[str, dict[str, int]]:
    """Per job, the slots it holds on each node: the members of its plan while it is not over,
    the nodes where any of its generations still starts, runs or stops (by the reports), and
    the members of a plan being committed right now (``inflight``)."""
    held: dict[str, dict[str, int]] = {}
    for view in cluster.jobs.values():
        mine: dict[str, int] = {}
        per_node = view.spec.workers_per_node if view.spec else 0
        if view.plan is not None and not view.status.state.terminal:
            for m in view.plan.members:
                mine[m.node_id] = m.local_workers
        for reps in view.reports.values():
            for node_id, rep in reps.items():
                if not rep.state.terminal:
                    member = view.plan.member(node_id) if view.plan else None
                    mine[node_id] = max(mine.get(node_id, 0), member.local_workers if member else per_node)
        plan = inflight.get(view.name)
        for m in plan.members if plan else ():
            mine[m.node_id] = max(mine.get(m.node_id, 0), m.local_workers)
        if mine:
            held[view.name] = mine
    return held


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    node_id: str
    control_address: str
    lease_ttl_s: int
    reconcile_interval_s: float = 1.0
    push_timeout_s: float = 10.0
    #: A member that has not reported on the current generation is pushed again after this long.
    repush_after_s: float = 3.0
    #: A member whose agent keeps refusing the pushes for lack of rights (PERMISSION_DENIED,
    #: UNAUTHENTICATED) or over a record it cannot read (FAILED_PRECONDITION) this long fails
    #: the job, with the agent's reason: it will not accept a push until someone changes its
    #: configuration, and the job must not stay RUNNING with a rank that never starts.
    denied_push_fail_s: float = 15.0
    ports: PortRange = PortRange()
    tls: TlsFiles = TlsFiles()
    #: Record each running job's step in its events this often (0: never).
    progress_interval_s: float = 10.0
    #: Events kept per job: the oldest are deleted once there are more, and any older than
    #: ``keep_events_s`` (see PRUNE_EVERY_S for when).
    keep_events: int = 2000
    keep_events_s: float = 30 * 24 * 3600.0
    #: Generations of reports kept per job (a pass reads two, the history's checks all that are kept).
    keep_report_generations: int = 50
    #: This node's local socket (``unix:PATH``): its own agent is reached there.
    local_socket: str = ""
    #: Watch the connections to the members' agents (see :mod:`mselastic.daemon.liveness`). Off
    #: only where the members have no agents at all (``bench/coordinator_scale.py``).
    peer_evidence: bool = True


@dataclasses.dataclass
class JobMemo:
    """What this leader keeps about one job between passes: forgetting a job is one delete.
    Times are this leader's monotonic clock; (generation, node id) keys name a member."""

    #: (time, step) of the last progress event written, and the one the step rate is measured from.
    progress: tuple[float, int] = (0.0, -1)
    rate: tuple[float, int] = (0.0, -1)
    #: Progress events written by this leader (events are pruned every 100).
    progress_events: int = 0
    #: When its events were last pruned.
    pruned_at: float = -PRUNE_EVERY_S
    #: The work queue's rate limiting: consecutive failed passes, and when the job may be handled again.
    failures: int = 0
    retry_at: float = 0.0
    #: When the plan was last pushed to a member, and a Stop sent again (see Coordinator._restop).
    pushed: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    restopped: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    #: Members whose agent refuses the pushes for good: since when, and why.
    denied: dict[tuple[int, str], tuple[float, str]] = dataclasses.field(default_factory=dict)
    # For one term (see Coordinator._on_my_clock and _note_recovery):
    #: Another writer's times in its status, (what, stamp) -> the same on this leader's clock.
    anchors: dict[tuple[str, float], float] = dataclasses.field(default_factory=dict)
    #: generation -> when this leader committed it to recover from a fault, and when a pass first
    #: saw a first step of it (a job's task may be busy then).
    relaunched: dict[int, float] = dataclasses.field(default_factory=dict)
    first_step: dict[int, float] = dataclasses.field(default_factory=dict)

    def new_term(self) -> None:
        self.anchors.clear()
        self.relaunched.clear()
        self.first_step.clear()


class Coordinator:
    def __init__(self, store: Store, cfg: CoordinatorConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.agents = Agents(cfg.push_timeout_s, cfg.tls,
                             {cfg.control_address: cfg.local_socket} if cfg.local_socket else None,
                             keepalive=cfg.peer_evidence)
        #: Per job, what this leader keeps about it between passes.
        self._memos: dict[str, JobMemo] = {}
        self.term: Term | None = None
        self.leading = asyncio.Event()
        self._wake = asyncio.Event()
        self._fenced = asyncio.Event()
        #: The leader's cache of the cluster (None: passes read etcd directly, as a bench may).
        self.informer: Informer | None = None
        self.passes = 0
        #: The work queue: at most one task per job; a job whose pass raised waits until its retry time.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Plans being committed by a job's task: their slots are held until the view shows them.
        self._inflight: dict[str, Plan] = {}
        #: Jobs waiting (in the last pass) only for slots other jobs hold, in submission order.
        self._queued: set[str] = set()
        #: The members this leader cannot count on, and the jobs held for them.
        self.presence = Presence(cfg.node_id, cfg.lease_ttl_s, self.agents, self._wake.set, cfg.peer_evidence)
        #: One clock per decision (see :meth:`_on_my_clock`): the times this leader wrote in statuses
        #: during its term (another writer's: JobMemo.anchors).
        self._mine: set[float] = set()

    # -- leadership ----------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        record = LeaderRecord(self.cfg.node_id, self.cfg.control_address).to_json()
        election = Election(self.store, record, self.cfg.lease_ttl_s)
        try:
            while not stop.is_set():
                term = await election.campaign(stop)
                if term is None:
                    break
                self.term = term
                self.leading.set()
                metrics.LEADER.set(1)
                log.info("leading (fencing token %d)", term.create_revision, extra=dict(node=self.cfg.node_id))
                try:
                    await self._lead(term, stop)
                finally:
                    metrics.LEADER.set(0)
                    self.leading.clear()
                    self.term = None
                    await election.resign(term)
                    log.info("no longer leading", extra=dict(node=self.cfg.node_id))
        finally:
            await self.agents.close()

    async def _lead(self, term: Term, stop: asyncio.Event) -> None:
        self.informer = Informer(self.store, on_change=self._wake.set)
        watcher = asyncio.create_task(self.informer.run(stop), name="coordinator-informer")
        self._fenced.clear()
        self._mine.clear()
        for memo in self._memos.values():
            memo.new_term()
        try:
            while not stop.is_set() and not term.lease.lost.is_set() and not self._fenced.is_set():
                if term.lease.unreachable.is_set():
                    # It can decide nothing. Once its lease may have run out it steps down: while its
                    # renewals still reach etcd (a one-way cut) nobody else could lead (the revoke
                    # may get there too). Not sooner: an etcd leader election would change leaders too.
                    left = term.lease.valid_until - fencing.clock()
                    if left <= 0:
                        log.warning("stepping down: etcd has not answered this leader's renewals for its whole "
                                    "lease (%ss)", term.lease.ttl_s, extra=dict(node=self.cfg.node_id))
                        break
                    await first(stop, term.lease.lost, timeout_s=min(left, 0.25))
                    continue
                if watcher.done():  # the informer died of a bug: its cache is frozen, so start it again
                    error = watcher.exception() if not watcher.cancelled() else None
                    log.error("the cluster cache stopped (%s); listing again", error, exc_info=error)
                    self.informer = Informer(self.store, on_change=self._wake.set)
                    watcher = asyncio.create_task(self.informer.run(stop), name="coordinator-informer")
                began = time.monotonic()
                try:
                    await self.reconcile(term)
                except Fenced:
                    self._fenced.set()
                except TemporaryError as e:
                    metrics.ETCD_ERRORS.labels("unavailable").inc()
                    log.warning("reconcile pass skipped, etcd unavailable: %s", e)
                except PermanentError as e:
                    metrics.ETCD_ERRORS.labels("permanent").inc()
                    log.error("reconcile pass failed: %s", e)
                except Exception:  # a bug in the pass itself (not in one job's): never end the daemon
                    log.exception("reconcile pass failed; the next pass tries again")
                if self._fenced.is_set():
                    break
                await self._sleep(stop, term, rest_s=min(MAX_REST_S, PASS_REST * (time.monotonic() - began)))
            if self._fenced.is_set():
                log.warning("deposed: the leader key is no longer ours", extra=dict(node=self.cfg.node_id))
        finally:
            watcher.cancel()
            tasks = list(self._tasks.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(watcher, *tasks, return_exceptions=True)
            self._tasks.clear()
            self._inflight.clear()
            self.informer = None
            await self.presence.end_term()
            self.agents.prune(set())  # (no longer leading: each closes once its last call is over)

    async def _sleep(self, stop: asyncio.Event, term: Term, rest_s: float = 0.0) -> None:
        """Until a change wakes the loop (or ``reconcile_interval_s``), but first ``rest_s``: changes
        that come meanwhile make one pass, not one each (thousands of nodes report every second)."""
        if rest_s > 0:
            await first(stop, term.lease.lost, term.lease.unreachable, timeout_s=rest_s)
        await first(self._wake, stop, term.lease.lost, term.lease.unreachable,
                        timeout_s=self.cfg.reconcile_interval_s)
        self._wake.clear()

    # -- one pass ------------------------------------------------------------

    async def reconcile(self, term: Term) -> None:
        """One pass: decide for every job in submission order, then hand each decision to the job's
        task. Deciding is pure and quick; applying it (etcd writes, pushes) runs in the tasks."""
        informer = self.informer
        if informer is not None and not informer.synced.is_set():
            return  # the first list is under way; it wakes the loop when done
        seen = informer.view() if informer is not None else await read_cluster(self.store)
        cluster = self.presence.suspected(seen)
        excused = self.presence.excused(cluster, {n.node_id for n in seen.nodes})
        self.passes += 1
        now, mono = time.time(), time.monotonic()
        self._settle_inflight(cluster)
        held = slots_held(cluster, self._inflight)
        # The first job (in submission order) that waits for slots others hold; a job skipped below
        # (its task still runs, or it backs off) keeps the place it had in the last pass.
        queue_head = ""
        queued: set[str] = set()
        for view in cluster.jobs.values():
            self._note_first_step(view, mono)
            if view.name in excused:
                continue
            if view.name in self._tasks or self._memo(view.name).retry_at > mono:
                if view.name in self._queued and view.plan is None:
                    queued.add(view.name)
                    queue_head = queue_head or view.name
                continue
            view = self._on_my_clock(view, now)
            try:
                decision, for_slots = self._decide(view, cluster, held, queue_head, now, may_grow=not self._queued)
            except Exception as e:
                self._start(view.name, self._raise(e))
                continue
            if for_slots:
                queued.add(view.name)
                queue_head = queue_head or view.name
            if decision is not None and decision.action is Action.LAUNCH and decision.plan is not None:
                mine = held.setdefault(view.name, {})
                for m in decision.plan.members:
                    mine[m.node_id] = max(mine.get(m.node_id, 0), m.local_workers)
                self._inflight[view.name] = decision.plan
            self._start(view.name, self._apply(term, view, decision, slot_wait=for_slots))
        self._queued = queued
        await self._finish_drains(term, cluster, held)

    def _memo(self, job: str) -> JobMemo:
        return self._memos.setdefault(job, JobMemo())

    def _note_first_step(self, view: JobView, mono: float) -> None:
        memo, g = self._memo(view.name), view.plan.generation if view.plan else -1
        if g in memo.relaunched and g not in memo.first_step and any(
                r.first_step_at for r in view.current_reports().values()):
            memo.first_step[g] = mono

    def _on_my_clock(self, view: JobView, now: float) -> JobView:
        """The job with the times its status holds on this leader's clock.

        ``waiting_since`` (min_nodes_timeout_s), ``scale_up_since`` (scale_up_settle_s) and the
        quarantine deadlines are wall-clock times written by a leader; another leader (after a
        failover, on another machine) would compare them with its own clock, and a skew between the
        two would shorten or lengthen the wait. So a time this leader did not write in its term is
        taken to start when it first sees it (a wait restarts, a quarantine lasts its whole cooldown
        again: at most one more wait, never a shorter one), and is written back on its clock with
        the next status write."""
        st, anchors = view.status, self._memo(view.name).anchors

        def since(what: str, stamp: float) -> float:
            if not stamp or stamp in self._mine:
                return stamp
            return anchors.setdefault((what, stamp), now)

        def until(node_id: str, stamp: float) -> float:
            # Over by this clock: over (a skew can end it early by the skew, never bring it back).
            if stamp in self._mine or view.spec is None or stamp <= now:
                return stamp
            over = st.node_failures.get(node_id, 0) - view.spec.quarantine_after_failures
            cooldown = min(MAX_QUARANTINE_S, view.spec.quarantine_cooldown_s * 2 ** max(0, over))
            return anchors.setdefault((f"quarantine:{node_id}", stamp), now + cooldown)

        waiting, scale_up = since("waiting", st.waiting_since), since("scale_up", st.scale_up_since)
        quarantine = {n: until(n, t) for n, t in st.quarantined_until.items()}
        if (waiting, scale_up, quarantine) == (st.waiting_since, st.scale_up_since, st.quarantined_until):
            return view
        return dataclasses.replace(view, status=dataclasses.replace(st, waiting_since=waiting, scale_up_since=scale_up,
                                                                    quarantined_until=quarantine))

    def _wrote(self, status: JobStatus) -> None:
        """Remember the times of a status this leader composed (they are on its clock)."""
        self._mine.update(t for t in (status.waiting_since, status.scale_up_since, *status.quarantined_until.values())
                          if t)

    async def _finish_drains(self, term: Term, cluster: ClusterView, held: dict[str, dict[str, int]]) -> None:
        """A draining node that no job holds any more is drained: it stays cordoned (no new
        generations) but no longer shows Draining. Compare-and-set on the cordon record, so an
        uncordon meanwhile is not undone."""
        busy = {node_id for nodes in held.values() for node_id in nodes}
        k, tx = self.store.keys, self.store.tx
        for node in cluster.nodes:
            if not node.draining or node.node_id in busy:
                continue
            kv = await self.store.get(k.cordon(node.node_id))
            if kv is None:
                continue
            try:
                rec = CordonRecord.from_json(kv.value)
            except MalformedRecord as e:  # logged by the view already; must not stop the pass
                log.debug("cordon record of %s unreadable: %s", node.node_id, e)
                continue
            done = dataclasses.replace(rec, drain=False)
            if await self.store.txn([term.guard(self.store),
                                     tx.mod(k.cordon(node.node_id).encode()) == kv.mod_revision],
                                    [tx.put(k.cordon(node.node_id).encode(), done.to_json().encode())]):
                log.info("node %s drained: no job runs there; it stays cordoned", node.node_id,
                         extra=dict(node=node.node_id))

    def _settle_inflight(self, cluster: ClusterView) -> None:
        """Forget a plan being committed once the view shows it (or shows that it cannot be): until
        then its slots stay held, even after its task ended, so that no pass on a cache that has not
        seen the commit yet gives them to another job."""
        for job, plan in list(self._inflight.items()):
            view = cluster.jobs.get(job)
            if job in self._tasks:
                continue
            if view is None or view.status.state.terminal or (view.plan and view.plan.generation >= plan.generation):
                del self._inflight[job]

    def _decide(self, view: JobView, cluster: ClusterView, held: dict[str, dict[str, int]], queue_head: str,
                now: float, may_grow: bool = True) -> tuple[Decision | None, bool]:
        """The planner's decision for one job (None: the spec is unreadable), and whether the job
        waits only because other jobs hold the slots it needs (it would launch on an empty cluster):
        such a wait is not timed by ``min_nodes_timeout_s``. ``may_grow`` False (a job is queued):
        no scale-up into free slots. Raises on records it cannot act on."""
        if view.errors:
            raise MalformedRecord("; ".join(view.errors))
        if view.spec is None:
            return None, False
        others: dict[str, int] = {}
        holders: dict[str, list[str]] = {}
        for job, nodes in held.items():
            if job == view.name:
                continue
            for node_id, n in nodes.items():
                others[node_id] = others.get(node_id, 0) + n
                holders.setdefault(node_id, []).append(job)
        free = {n.node_id: max(0, n.slots - others.get(n.node_id, 0)) for n in cluster.nodes}
        busy = "; ".join(f"node {n.node_id}: {free[n.node_id]} of {n.slots} slot(s) free, the rest held by job(s) "
                         f"{', '.join(sorted(holders[n.node_id]))}" for n in cluster.nodes[:5] if n.node_id in holders)
        if queue_head and view.plan is None:
            free = {n: 0 for n in free}
            busy = f"queued behind job {queue_head} (first come, first served)"

        def plan_with(free_slots: dict[str, int] | None, why: str) -> Decision:
            assert view.spec is not None
            return decide(view.spec, view.status.state, view.plan, view.current_reports(), cluster.nodes,
                          self.cfg.ports, salt=cluster.revision, now=now, status=view.status,
                          free_slots=free_slots, busy=why, may_grow=may_grow or view.name in self._queued)

        decision = plan_with(free, busy)
        for_slots = (view.plan is None and decision.action is Action.WAIT
                     and plan_with(None, "").action is Action.LAUNCH)
        return decision, for_slots

    def _start(self, job: str, work: Awaitable[None]) -> None:
        """Run one job's work in its own task (the work queue's worker for that key)."""
        async def run() -> None:
            try:
                await work
                self._memo(job).failures = 0
            except Fenced:
                self._fenced.set()
                self._wake.set()
            except TemporaryError as e:
                self._inflight.pop(job, None)  # committed or not: the view will say
                metrics.ETCD_ERRORS.labels("unavailable").inc()
                log.warning("job pass not finished, etcd unavailable: %s", e, extra=dict(job=job))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._inflight.pop(job, None)
                await self._job_failed(job, e)
            finally:
                self._tasks.pop(job, None)
        self._tasks[job] = asyncio.create_task(run(), name=f"job-{job}")

    @staticmethod
    async def _raise(error: Exception) -> None:
        """A decision that raised, handed to the job's task so that it is handled like any job error."""
        raise error

    async def _job_failed(self, job: str, error: Exception) -> None:
        """A job's pass raised: log it with its traceback, show it on the job, retry it later."""
        memo = self._memo(job)
        memo.failures = n = memo.failures + 1
        delay = requeue_delay_s(n)
        memo.retry_at = time.monotonic() + delay
        text = f"{type(error).__name__}: {error}"
        log.error("job pass failed (%d in a row; retried in %.1fs): %s", n, delay, text, exc_info=error,
                  extra=dict(job=job))
        metrics.JOB_ERRORS.labels(job).inc()
        term = self.term
        if term is None:
            return
        k, tx = self.store.keys, self.store.tx
        message = f"reconcile error (retry {n}, next in {delay:.0f}s): {text}"[:2000]
        event = Event(at=time.time(), kind=EventKind.ERROR, generation=0, message=message)
        try:
            if not await self.store.txn([term.guard(self.store)],
                                        [tx.put(k.event(job, time.time_ns()).encode(), event.to_json().encode())]):
                self._fenced.set()
            await self._show_error(term, job, message)
            if n % 20 == 1:  # a job that keeps failing must not grow its events without bound
                await self.prune_events(term, job)
        except (TemporaryError, PermanentError) as e:
            log.warning("error event not written: %s", e, extra=dict(job=job))
        except Fenced:
            self._fenced.set()
        self._wake.set()

    async def _show_error(self, term: Term, job: str, message: str) -> None:
        """The error as the job's status message too, state unchanged (compare-and-set), when the
        status can be read: it may be the very record that is malformed, then the event alone says it."""
        k, tx = self.store.keys, self.store.tx
        kv = await self.store.get(k.status(job))
        if kv is None:
            return
        try:
            status = JobStatus.from_json(kv.value)
        except MalformedRecord:
            return
        if status.state.terminal:
            return
        shown = dataclasses.replace(status, message=message, updated_at=time.time())
        await self.store.txn([term.guard(self.store),
                              tx.mod(k.status(job).encode()) == kv.mod_revision],
                             [tx.put(k.status(job).encode(), shown.to_json().encode())])

    async def _apply(self, term: Term, view: JobView, d: Decision | None, slot_wait: bool = False) -> None:
        try:
            await self._apply_decision(term, view, d, slot_wait)
        finally:  # after the decision: housekeeping never holds a job's decision back
            memo = self._memo(view.name)
            if time.monotonic() - memo.pruned_at >= PRUNE_EVERY_S:
                memo.pruned_at = time.monotonic()
                try:
                    await self.prune_events(term, view.name)
                except (TemporaryError, PermanentError) as e:
                    log.warning("events not pruned: %s", e, extra=dict(job=view.name))

    async def _apply_decision(self, term: Term, view: JobView, d: Decision | None, slot_wait: bool) -> None:
        if d is None:
            if not view.status.state.terminal:
                await self._set_status(term, view, JobState.FAILED, f"spec unreadable: {view.spec_error}")
            await self._restop(view, grace_s=10.0)
            return
        assert view.spec is not None
        if view.status.state.terminal:
            await self._note_recovery(term, view)  # a job may end before its recovery was recorded
            await self._note_stopped_at(term, view)
            await self._restop(view, view.spec.stop_grace_period_s)
            return
        if d.action is Action.LAUNCH:
            assert d.plan is not None
            if d.plan.planned and view.plan is not None:
                # The step the running generation stops at goes in the plan: the members that go on
                # read it from their Launch, the dropped ones from their Stop; all the ranks stop there.
                at = await self.agents.stop_step(view.name, view.plan.generation,
                                                 {m.node_id: m.agent_address for m in view.plan.members})
                d = dataclasses.replace(d, plan=dataclasses.replace(d.plan, stop_previous_at_step=at))
            await self._commit_plan(term, view, d)
        elif d.action is Action.SUCCEED:
            await self._set_status(term, view, JobState.SUCCEEDED, d.reason)
        elif d.action is Action.FAIL:
            if await self._set_status(term, view, JobState.FAILED, d.reason, failure=self._failure(view, d),
                                      decision=d) and view.plan is not None:
                # After a fault (restarts exhausted) the collective is broken, as at a relaunch: the
                # ranks left could not reach a step to checkpoint at, and a grace period would only
                # hold the node's slots (a job waiting for them) for nothing. Killed at once.
                grace = 0.0 if d.fault is not None or d.lost_nodes else view.spec.stop_grace_period_s
                await self.agents.stop(view.name, view.plan.generation, grace,
                                       {m.node_id: m.agent_address for m in view.plan.members})
        elif d.action is Action.WAIT:
            # A wait for slots other jobs hold is a queue, not a shortage of nodes: not timed.
            state = JobState.PENDING if view.plan is None else JobState.RESTARTING
            since = 0.0 if slot_wait else (view.status.waiting_since or time.time())
            if (view.status.state, view.status.message, bool(view.status.waiting_since)) != (
                    state, d.reason, bool(since)):
                await self._set_status(term, view, state, d.reason, failure=self._failure(view, d),
                                       waiting_since=since, decision=d)
        else:
            await self._note_recovery(term, view)
            await self._note(term, view, d)
            await self._note_progress(term, view)
            await self._repush(term, view)

    async def _note_progress(self, term: Term, view: JobView) -> None:
        """Job gauges on every pass; a ``progress`` event every ``progress_interval_s`` (for reports)."""
        plan, step = view.plan, view.step
        if plan is None or view.status.state.terminal or step < 0:
            return
        now = time.monotonic()  # durations only; the event's time is the wall clock
        metrics.STEP.labels(view.name).set(step)
        metrics.WORLD_SIZE.labels(view.name).set(plan.world_size)
        metrics.GENERATION.labels(view.name).set(plan.generation)
        memo = self._memo(view.name)
        since, from_step = memo.rate
        if step < from_step or now - since > 30:
            memo.rate = (now, step)
        elif now - since >= 3 and step > from_step:
            metrics.STEP_RATE.labels(view.name).set((step - from_step) / (now - since))
            memo.rate = (now, step)
        last_at, last_step = memo.progress
        if self.cfg.progress_interval_s and step != last_step and now - last_at >= self.cfg.progress_interval_s:
            memo.progress = (now, step)
            k, tx = self.store.keys, self.store.tx
            event = Event(at=time.time(), kind=EventKind.PROGRESS, generation=plan.generation, message=f"step {step}", step=step,
                          world_size=plan.world_size, loss=view.loss)
            if not await self.store.txn([term.guard(self.store)],
                                        [tx.put(k.event(view.name, time.time_ns()).encode(), event.to_json().encode())]):
                raise Fenced()
            memo.progress_events = n = memo.progress_events + 1
            if n % 100 == 1:
                await self.prune_events(term, view.name)

    async def prune_events(self, term: Term, job: str) -> int:
        """Delete the job's events beyond the newest ``keep_events`` and those older than
        ``keep_events_s`` (event keys are their write time in ns, so both are one key range: one
        keys-only read, one range delete); returns how many were deleted."""
        k, tx = self.store.keys, self.store.tx
        keys = await self.store.keys_under(k.events(job))
        # Event keys are write times in ns: 19 digits since 2001, so they sort as numbers. The cut
        # must have 19 digits too, or a long keep_events_s would sort above every key.
        too_old = k.event(job, max(time.time_ns() - int(self.cfg.keep_events_s * 1e9), 10**18))
        cut = max(keys[len(keys) - self.cfg.keep_events] if len(keys) > self.cfg.keep_events else "", too_old)
        gone = sum(1 for key in keys if key < cut)
        if not gone:
            return 0
        if not await self.store.txn([term.guard(self.store)],
                                    [tx.delete(k.events(job).encode(), cut.encode())]):
            raise Fenced()
        log.info("pruned %d old events", gone, extra=dict(job=job))
        return gone

    async def _note(self, term: Term, view: JobView, d: Decision) -> None:
        """Keep the status's note (pending scale-up, idle nodes, a waiting drain) current."""
        old = view.status
        if view.plan is None or old.state.terminal or (old.note, old.scale_up_nodes, old.scale_up_since) == (
                d.note, d.scale_up_nodes, d.scale_up_since):
            return
        status = dataclasses.replace(self._status(view, old.state, old.message, old.last_failure),
                                     note=d.note, scale_up_nodes=d.scale_up_nodes, scale_up_since=d.scale_up_since)
        event = Event(at=time.time(), kind=EventKind.NOTE, generation=view.plan.generation, message=d.note or "note cleared")
        await self.write_status(term, view, status, event if d.note != old.note else None)

    def _failure(self, view: JobView, d: Decision) -> FailureRecord | None:
        if view.plan is None or (d.fault is None and not d.lost_nodes):
            return view.status.last_failure
        if d.fault is not None:
            return FailureRecord(generation=view.plan.generation, node_id=d.fault.node_id, rank=d.fault.failed_rank,
                                 reason=d.fault.reason, detected_at=d.fault.detected_at, cause=d.fault.cause)
        return FailureRecord(generation=view.plan.generation, node_id=",".join(d.lost_nodes), rank=-1,
                             reason="node lost (lease expired)", detected_at=time.time(), cause=FailureCause.NODE_LOST)

    async def _commit_plan(self, term: Term, view: JobView, d: Decision) -> None:
        assert d.plan is not None and view.spec is not None
        k, tx = self.store.keys, self.store.tx
        failure = self._failure(view, d)
        status = self._status(view, JobState.RUNNING, d.reason, failure, d.plan, decision=d)
        self._wrote(status)
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
                   self._status_unchanged(view)]
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
            self._inflight.pop(view.name, None)
            await self._check_leader(term)
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
        """Push the committed plan again to members that have not reported on it (missed push);
        fail the job when a member's agent has refused it for good for ``denied_push_fail_s``."""
        plan = view.plan
        if plan is None or view.status.state.terminal or view.spec is None:
            return
        reports = view.current_reports()
        now = time.monotonic()
        memo = self._memo(view.name)
        for m in plan.members:
            since, why = memo.denied.get((plan.generation, m.node_id), (now, ""))
            if why and m.node_id not in reports and now - since >= self.cfg.denied_push_fail_s:
                message = (f"node {m.node_id} refused generation {plan.generation} for {now - since:.0f} s "
                           f"({why}); resubmit once its configuration is fixed")
                if await self._set_status(term, view, JobState.FAILED, message):
                    await self.agents.stop(view.name, plan.generation, view.spec.stop_grace_period_s,
                                           {m.node_id: m.agent_address for m in plan.members})
                return
        missing = [m for m in plan.members if m.node_id not in reports
                   and now - memo.pushed.get((plan.generation, m.node_id), 0) > self.cfg.repush_after_s]
        if missing:
            self._mark_pushed(plan, {m.node_id for m in missing})
            self._note_denials(plan, await self.agents.launch(plan, only={m.node_id for m in missing}))

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

    async def _note_stopped_at(self, term: Term, view: JobView) -> None:
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
        await self._set_status(term, view, JobState.STOPPED, message, event=Event(
            at=time.time(), kind=EventKind.STOPPED, generation=view.plan.generation, message=message))

    async def _restop(self, view: JobView, grace_s: float) -> None:
        """A job that is over but whose generation still starts, runs or stops somewhere (by the
        reports): its Stop was lost (an agent was unreachable for a moment). Send it again, to those
        nodes only, at most every ``repush_after_s``."""
        now, restopped = time.monotonic(), self._memo(view.name).restopped
        for generation, reps in view.reports.items():
            nodes = {}
            for node_id, rep in reps.items():
                member = view.plan.member(node_id) if view.plan else None
                key = (generation, node_id)
                if rep.state.terminal or member is None or now - restopped.get(key, 0.0) < self.cfg.repush_after_s:
                    continue
                restopped[key] = now
                nodes[node_id] = member.agent_address
            if nodes:
                log.warning("stopping generation %d again on %s: the job is %s", generation, ", ".join(sorted(nodes)),
                            view.status.state.value, extra=dict(job=view.name, generation=generation))
                await self.agents.stop(view.name, generation, grace_s, nodes)

    def forget(self, job: str) -> None:
        """A deleted job: drop what this leader keeps about it, and its metrics."""
        self._memos.pop(job, None)
        self._queued.discard(job)
        metrics.forget_job(job)

    def _mark_pushed(self, plan: Plan, only: set[str] | None = None) -> None:
        now, pushed = time.monotonic(), self._memo(plan.job).pushed
        for m in plan.members:
            if only is None or m.node_id in only:
                pushed[(plan.generation, m.node_id)] = now

    async def _note_recovery(self, term: Term, view: JobView) -> None:
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
        recovered = dataclasses.replace(f, recover_s=max(0.001, round(memo.first_step.pop(g) - memo.relaunched.pop(g), 3)))
        metrics.RECOVERY.labels(view.name).observe(recovered.recover_s)
        resumed = max((r.resumed_step for r in reports), default=-1)
        notes = sorted({r.resume_note for r in reports if r.resume_note})
        await self._set_status(term, view, view.status.state, view.status.message, failure=recovered,
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
        await self.write_status(term, view, status, Event(
            at=time.time(), kind=EventKind.RESUMED, generation=plan.generation,
            message=f"generation {plan.generation} resumed from step {resumed}; generation {plan.generation - 1} "
                    f"checkpointed at step(s) {exits} on request; {lost}"))

    # -- status writes -------------------------------------------------------

    def _status(self, view: JobView, state: JobState, message: str, failure: FailureRecord | None,
                plan: Plan | None = None, waiting_since: float = 0.0, decision: Decision | None = None) -> JobStatus:
        """The next status of the job as ``view`` read it (see :func:`mselastic.core.status.next_status`)."""
        return next_status(view.status, state, message, time.time(), plan=plan or view.plan, failure=failure,
                           waiting_since=waiting_since, decision=decision)

    async def _set_status(self, term: Term, view: JobView, state: JobState, message: str,
                          failure: FailureRecord | None = None, event: Event | None = None,
                          waiting_since: float = 0.0, decision: Decision | None = None) -> bool:
        """Write the job's next status (compare-and-set); False when it changed meanwhile."""
        failure = failure if failure is not None else view.status.last_failure
        status = self._status(view, state, message, failure, waiting_since=waiting_since, decision=decision)
        ev = event or Event(at=time.time(), kind=EventKind(state.value.lower()),
                            generation=view.plan.generation if view.plan else 0, message=message)
        if not await self.write_status(term, view, status, ev):
            return False
        log.info("job %s: %s", state.value, message, extra=dict(job=view.name, generation=status.generation))
        return True

    def _status_unchanged(self, view: JobView) -> object:
        """The compare of a compare-and-set on the job's status as ``view`` read it."""
        key = self.store.keys.status(view.name).encode()
        return self.store.tx.mod(key) == (view.status_kv.mod_revision if view.status_kv else 0)

    async def write_status(self, term: Term, view: JobView, status: JobStatus, event: Event | None) -> bool:
        """Compare-and-set the job's status on the revision ``view`` read (and the leader key).

        True: written, and ``view`` now holds it (so that a pass's further writes chain). False:
        the status changed meanwhile (an operator's stop or restart, for instance); nothing is
        written and the next pass decides again. Raises Fenced when the leader key is not ours."""
        k, tx = self.store.keys, self.store.tx
        self._wrote(status)
        kv = await self.store.txn_get(
            [term.guard(self.store), self._status_unchanged(view)],
            [tx.put(k.status(view.name).encode(), status.to_json().encode()),
             *([tx.put(k.event(view.name, time.time_ns()).encode(), event.to_json().encode())] if event else [])],
            k.status(view.name))
        if kv is None:
            await self._check_leader(term)
            log.info("status changed meanwhile; the next pass decides again", extra=dict(job=view.name))
            return False
        view.status, view.status_kv = status, kv
        return True

    async def _check_leader(self, term: Term) -> None:
        kv = await self.store.get(self.store.keys.leader)
        if kv is None or kv.create_revision != term.create_revision:
            raise Fenced()

    def wake(self) -> None:
        self._wake.set()

