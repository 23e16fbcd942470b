"""The coordinator: every elasticd campaigns; the leader runs the reconcile loop.

Level-triggered: a pass reads the whole state from etcd and asks the planner what
to do for each job, in submission order (slots are shared: a job is placed only on
slots no other job holds, first come, first served: :mod:`~mselastic.daemon.admission`).
Each job's decision is then applied by a task of its own, as a controller's work queue
does (:mod:`~mselastic.daemon.workqueue`): one job's slow push or exception never delays
or stops another, a job is handled by one task at a time, and a job whose pass raised is
retried with backoff, the error shown on the job. A pass reads no etcd: the leader keeps an
:class:`~mselastic.store.informer.Informer` (list, then watch, re-list when the watch
breaks), and a change it applies wakes the loop. Passes also run at least every
``reconcile_interval_s``, so a missed push is repaired by the next pass.

Every write of a plan or a job status is one transaction that checks that this
process still holds the leader key (its create revision is the fencing token) and
that the job's status (and, for plans, the stored plan) is still the one the
decision was made on (:mod:`~mselastic.daemon.statuses`): a ``stop`` or ``restart``
written by the Control service meanwhile makes the write fail, and the next pass decides
again from what is stored. What the leader records beside its decisions (progress,
recovery times, pruning) is :mod:`~mselastic.daemon.history`'s; applying a decision,
:mod:`~mselastic.daemon.apply`'s; who may be counted on,
:mod:`~mselastic.daemon.presence`'s; the pushes to the agents, :mod:`~mselastic.daemon.agents`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import zlib
from typing import Awaitable

from mselastic import metrics
from mselastic.core import devices, fencing
from mselastic.core.waits import first
from mselastic.core.kinds import EventKind
from mselastic.core.model import (CordonRecord, DeletedJob, Event, JobStatus, LeaderRecord, MalformedRecord,
                                  NodeRecord, Plan)
from mselastic.core.planner import NO_DEVICES, Decision, Launch, Nothing, PortRange, Wait, decide
from mselastic.store.etcd import PermanentError, Store, TemporaryError
from mselastic.store.informer import Informer
from mselastic.store.lease import Election, Term
from mselastic.store.views import ClusterView, JobView, read_cluster
from mselastic.daemon import admission
from mselastic.daemon.agents import Agents
from mselastic.daemon.apply import Applier
from mselastic.daemon.history import History, Keep
from mselastic.daemon.memo import JobMemo
from mselastic.daemon.presence import Presence
from mselastic.daemon.statuses import Fenced, Statuses
from mselastic.daemon.workqueue import WorkQueue
from mselastic.tls import TlsFiles

log = logging.getLogger(__name__)


#: After a pass, the loop rests this many times the pass's duration before the next one: passes
#: use at most a third of a core however fast changes come (at 4,000 nodes reporting every second
#: they would otherwise run back to back), and a small cluster's pass of a few ms rests a few ms.
PASS_REST = 2.0
#: ... at most (a pass slowed by etcd retries must not hold the next one back for long).
MAX_REST_S = 1.0
#: The cluster's gauges (devices, job states, nodes) are counted at most this often (a pass at
#: 4,000 nodes of 8 devices need not).
CLUSTER_METRICS_S = 5.0
#: How long a reconcile pass may go on once elasticd is stopping.
STOP_PASS_S = 1.0
#: A leader tells every node again of the jobs deleted this long before its term began (its
#: predecessor may have been deposed before its pass did: Coordinator._gone).
RECENT_DELETE_S = 600.0


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


def _registered(cluster: ClusterView) -> dict[str, bool]:
    """Each node a metric names: True registered; False not, while a job that has not ended counts
    on it (its current plan) or a cordon names it (until ``elasticctl remove-node``)."""
    named = set(cluster.cordons) | {m.node_id for v in cluster.jobs.values() if v.plan is not None
                                    and not v.status.state.terminal for m in v.plan.members}
    return {**{n: False for n in named}, **{n.node_id: True for n in cluster.nodes}}


def deleted_to_tell(known: set[str], deleted: set[str], jobs: set[str], busy: set[str]) -> tuple[list[str], set[str]]:
    """The deleted jobs a pass tells every node of: those the last pass saw (``known``) or not told
    yet (``deleted``) that are not jobs now (``jobs``: a name submitted again is not gone), and
    whose worker does not run (``busy``: one worker per job); and those left for a later pass."""
    gone = (known | deleted) - jobs
    return sorted(gone - busy), gone & busy


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
        self._shown_at = -CLUSTER_METRICS_S
        self._shown: metrics.Shown = {}  # (the series set: removed when what they name is gone)
        #: The work queue: at most one task per job; a job whose pass raised waits until its retry time.
        self.queue = WorkQueue()
        #: Plans being committed by a job's task: their slots are held until the view shows them.
        self._inflight: dict[str, Plan] = {}
        #: Jobs waiting (in the last pass) only for slots other jobs hold, in submission order.
        self._queued: set[str] = set()
        #: The jobs the last pass saw (one gone since was deleted: every node is told it ended), and
        #: those deleted and not told yet: at a term's first pass, those deleted shortly before it
        #: began (its predecessor may not have told the nodes; None: not read yet this term).
        self._known: set[str] = set()
        self._deleted_recently: set[str] | None = None
        self._term_began = 0.0
        #: The members this leader cannot count on, and the jobs held for them.
        self.presence = Presence(cfg.node_id, cfg.lease_ttl_s, self.agents, self._wake.set, cfg.peer_evidence)
        self.statuses = Statuses(store)
        self.history = History(store, Keep(cfg.progress_interval_s, cfg.keep_events, cfg.keep_events_s),
                               self.statuses, self._memo)
        self.applier = Applier(store, cfg, self.agents, self.statuses, self.history, self.presence, self._memo,
                               self._not_inflight)

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
                    self._shown = metrics.show_cluster({}, {}, {}, self._shown)  # (the leader's to say)
                    metrics.not_leading()
                    self.leading.clear()
                    self.term = None
                    await election.resign(term)
                    log.info("no longer leading", extra=dict(node=self.cfg.node_id))
        finally:
            await self.agents.close()

    async def _pass(self, term: Term, stop: asyncio.Event) -> None:
        """One reconcile pass. elasticd stopping gives it :data:`STOP_PASS_S` more, then cancels it
        (etcd away, a pass may sit in the store's retries for seconds, and elasticd must stop): a
        leader stopped mid-pass is one that crashed there, which the next leader's pass makes good."""
        task = asyncio.create_task(self.reconcile(term), name="reconcile")
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait([task], timeout=STOP_PASS_S)
        finally:
            stopping.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            log.info("reconcile pass cut short: elasticd is stopping", extra=dict(node=self.cfg.node_id))
            return
        task.result()

    async def _lead(self, term: Term, stop: asyncio.Event) -> None:
        self.informer = Informer(self.store, on_change=self._wake.set)
        watcher = asyncio.create_task(self.informer.run(stop), name="coordinator-informer")
        self._fenced.clear()
        self._known, self._deleted_recently, self._term_began = set(), None, time.time()
        self.statuses.new_term()
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
                    await self._pass(term, stop)
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
            await self.queue.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
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
        if mono - self._shown_at >= CLUSTER_METRICS_S:  # (devices, job states, nodes, for the metrics)
            self._shown_at = mono
            self._shown = metrics.show_cluster(
                devices.states(cluster.nodes, admission.devices_held(cluster, self._inflight), cluster.device_cordons,
                               now), {name: v.status.state for name, v in cluster.jobs.items()},
                _registered(seen), self._shown)
        self._inflight = admission.settled(self._inflight, cluster, self.queue.busy())
        held = admission.slots_held(cluster, self._inflight)
        devices_held = admission.devices_held(cluster, self._inflight)
        # The nodes as a new plan may use them: a node's devices set aside are none of its slots
        # (core.devices.usable). The registrations themselves say which members are lost.
        usable = devices.usable(cluster.nodes, cluster.device_cordons, now)
        # The first job (in submission order) that waits for slots others hold; a job skipped below
        # (its task still runs, or it backs off) keeps the place it had in the last pass.
        queue_head = ""
        queued: set[str] = set()
        if self._deleted_recently is None:  # (once a term; etcd away: the pass is skipped, the next tries)
            self._deleted_recently = await self._deleted_since(self._term_began - RECENT_DELETE_S)
        everyone = {n.node_id: n.agent_address for n in cluster.nodes}
        tell, self._deleted_recently = deleted_to_tell(self._known, self._deleted_recently, set(cluster.jobs),
                                                       self.queue.busy())
        for job in tell:
            self._start(job, self._gone(job, everyone))
        self._known = set(cluster.jobs)
        for view in cluster.jobs.values():
            self.history.note_first_step(view, mono)
            if view.name in excused:
                continue
            if self.queue.held_back(view.name, mono):
                if view.name in self._queued and view.plan is None:
                    queued.add(view.name)
                    queue_head = queue_head or view.name
                continue
            view = self.statuses.on_my_clock(view, now, self._memo(view.name).anchors)
            try:
                decision, for_slots = self._decide(view, cluster, held, queue_head, now, usable, devices_held,
                                                   may_grow=not self._queued)
            except Exception as e:
                self._start(view.name, self._raise(e))
                continue
            if for_slots:
                queued.add(view.name)
                queue_head = queue_head or view.name
            if isinstance(decision, Nothing) and decision.reason.startswith(NO_DEVICES):
                log.warning("%s", decision.reason, extra=dict(job=view.name))
            if isinstance(decision, Launch):
                admission.hold(held, view.name, decision.plan)
                devices.hold(devices_held, view.name, decision.plan)
                self._inflight[view.name] = decision.plan
            self._start(view.name, self.applier.apply(term, view, decision, slot_wait=for_slots))
        self._queued = queued
        await self._finish_drains(term, cluster, held)

    def _not_inflight(self, job: str) -> None:
        self._inflight.pop(job, None)

    def _port_salt(self, revision: int) -> int:
        """What varies a generation's master port besides its job and number: the etcd revision the
        pass read, and this cluster's namespace. Two clusters on one host (namespaces of one etcd,
        or etcds of their own at the same revision: test clusters side by side did so) would
        otherwise give a job of the same name the same port, and one's ranks register with the
        other's scheduler ("Repeated registration node")."""
        return revision ^ (zlib.crc32(self.store.keys.namespace.encode()) << 32)

    def _memo(self, job: str) -> JobMemo:
        return self._memos.setdefault(job, JobMemo())

    async def _finish_drains(self, term: Term, cluster: ClusterView, held: dict[str, dict[str, int]]) -> None:
        """A draining node that no job holds any more is drained: it stays cordoned (no new
        generations) but no longer shows Draining. Compare-and-set on the cordon record, so an
        uncordon meanwhile is not undone."""
        busy = {node_id for nodes in held.values() for node_id in nodes}
        for node in cluster.nodes:
            if not node.draining or node.node_id in busy:
                continue
            try:
                done = await self.store.update(self.store.keys.cordon(node.node_id), CordonRecord.from_json,
                                               lambda rec: dataclasses.replace(rec, drain=False),
                                               [term.guard(self.store)])
            except MalformedRecord as e:  # logged by the view already; must not stop the pass
                log.debug("cordon record of %s unreadable: %s", node.node_id, e)
                continue
            if done is not None:
                log.info("node %s drained: no job runs there; it stays cordoned", node.node_id,
                         extra=dict(node=node.node_id))

    def _decide(self, view: JobView, cluster: ClusterView, held: dict[str, dict[str, int]], queue_head: str,
                now: float, usable: list[NodeRecord], devices_held: dict[str, dict[int, str]],
                may_grow: bool = True) -> tuple[Decision | None, bool]:
        """The planner's decision for one job (None: the spec is unreadable), and whether the job
        waits only because other jobs hold the slots it needs (it would launch on an empty cluster):
        such a wait is not timed by ``min_nodes_timeout_s``. ``may_grow`` False (a job is queued):
        no scale-up into free slots. Raises on records it cannot act on."""
        if view.errors:
            raise MalformedRecord("; ".join(view.errors))
        if view.spec is None:
            return None, False
        free, busy = admission.free_slots(view.name, usable, held, queue_head, view.plan is not None, devices_held)
        capacity = {n.node_id: n.slots for n in usable}  # (an empty cluster's: its devices set aside excluded)

        def plan_with(free_slots: dict[str, int], why: str, probe: bool = False) -> Decision:
            assert view.spec is not None
            return decide(view.spec, view.status.state, view.plan, view.current_reports(), cluster.nodes,
                          self.cfg.ports, salt=self._port_salt(cluster.revision), now=now, status=view.status,
                          free_slots=free_slots, busy=why, may_grow=may_grow or view.name in self._queued,
                          devices=None if probe else {n.node_id: n for n in usable},
                          devices_held=None if probe else devices_held,
                          refused=self.applier.refusals(view), refused_fail_s=self.cfg.denied_push_fail_s)

        decision = plan_with(free, busy)
        for_slots = (view.plan is None and isinstance(decision, Wait)
                     and isinstance(plan_with(capacity, "", probe=True), Launch))
        return decision, for_slots

    def _start(self, job: str, work: Awaitable[None]) -> None:
        """Run one job's work as its worker in the work queue."""
        self.queue.start(job, work, self._job_error)

    async def _job_error(self, job: str, error: Exception) -> None:
        if isinstance(error, Fenced):
            self._fenced.set()
            self._wake.set()
            return
        self._inflight.pop(job, None)  # committed or not: the view will say
        if isinstance(error, TemporaryError):
            metrics.ETCD_ERRORS.labels("unavailable").inc()
            log.warning("job pass not finished, etcd unavailable: %s", error, extra=dict(job=job))
        else:
            await self._job_failed(job, error)

    @staticmethod
    async def _raise(error: Exception) -> None:
        """A decision that raised, handed to the job's task so that it is handled like any job error."""
        raise error

    async def _job_failed(self, job: str, error: Exception) -> None:
        """A job's pass raised: log it with its traceback, show it on the job, retry it later."""
        n, delay = self.queue.failed(job)
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
                await self.history.prune_events(term, job)
        except (TemporaryError, PermanentError) as e:
            log.warning("error event not written: %s", e, extra=dict(job=job))
        except Fenced:
            self._fenced.set()
        self._wake.set()

    async def _show_error(self, term: Term, job: str, message: str) -> None:
        """The error as the job's status message too, state unchanged (compare-and-set), when the
        status can be read: it may be the very record that is malformed, then the event alone says it."""
        with contextlib.suppress(MalformedRecord):
            await self.store.update(self.store.keys.status(job), JobStatus.from_json,
                                    lambda st: None if st.state.terminal else
                                    dataclasses.replace(st, message=message, updated_at=time.time()),
                                    [term.guard(self.store)])

    async def _deleted_since(self, since: float) -> set[str]:
        """The jobs deleted after ``since`` (their ``deleted/`` records): a leader deposed right after
        a delete may not have told the nodes; the next one does, once. (TemporaryError: its pass is
        skipped and the next one reads again.)"""
        _, kvs = await self.store.get_prefix(self.store.keys.deleted_prefix)
        found = set()
        for kv in kvs:
            with contextlib.suppress(MalformedRecord):
                if DeletedJob.from_json(kv.value).at >= since:
                    found.add(kv.key.rsplit("/", 1)[1])
        return found

    async def _gone(self, job: str, nodes: dict[str, str]) -> None:
        """``job`` was deleted (``deleted/<job>`` says up to which generation): every node lets its
        standbys and snapshot folder go (a node that misses this sweeps the folder after
        SNAPSHOT_KEEP_S; its standbys went when the generation ended). Up to its last generation:
        never a new job's of the same name."""
        kv = await self.store.get(self.store.keys.deleted(job))
        if kv is None:
            return
        await self.agents.stop(job, DeletedJob.from_json(kv.value).generation, 0.0, nodes, final=True)

    def forget(self, job: str) -> None:
        """A deleted job: drop what this leader keeps about it, and its metrics."""
        self._memos.pop(job, None)
        self.queue.forget(job)
        self._queued.discard(job)
        metrics.forget_job(job)

    async def write_status(self, term: Term, view: JobView, status: JobStatus, event: Event | None) -> bool:
        """See :meth:`Statuses.write`."""
        return await self.statuses.write(term, view, status, event)

    def wake(self) -> None:
        self._wake.set()

