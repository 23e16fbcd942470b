"""The node agent: registration under a lease, the local generations, reports to etcd.

The agent acts only on a plan that is newer than what it runs and equal to the
plan committed in etcd (the coordinator's push may be stale or from a deposed
leader). When etcd cannot be reached for most of a TTL, it asks its peers every
TTL/3 whether they reach etcd, and stops its workers when the fencing rule says so
(:func:`mselastic.core.fencing.node_verdict`; see :meth:`NodeAgent._fence_round`).
When etcd then says its lease expired with the workers still running (etcd was away
for every node: a stall), it registers again and keeps the generations etcd still has
committed; the coordinator adopts them (see ``Presence.excused``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Collection, Coroutine

import grpc

from mselastic import __version__
from mselastic.agent import committed
from mselastic.agent.containment import logcap
from mselastic.agent.generation import adopt, shim
from mselastic.agent.config import AgentConfig
from mselastic.agent.peers import Peers, reaches_etcd
from mselastic.agent.standbys.pools import WarmPools
from mselastic.agent.reports import Reports
from mselastic.agent.devices.health import DeviceHealth, unfit
from mselastic.agent.generation.launch import release_standby_group, remove_exits, spawn_standby
from mselastic.agent.generation.launch_env import LaunchEnv
from mselastic.agent.generation import learned as learned_rules
from mselastic.agent.generation.learned import Learned
from mselastic.agent.containment.snapshot_folders import remove_snapshot_folder, sweep_snapshot_folders
from mselastic.agent.generation.supervisor import Generation, Phase
from mselastic.agent.containment.users import WorkerUser
from mselastic.core import fencing
from mselastic.core.waits import first
from mselastic.core.model import GenerationReport, JobStatus, MalformedRecord, NodeRecord, Plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import FailureCause, GenerationState, NodeState, check_node_transition
from mselastic.core.waits import within
from mselastic.store.etcd import KV, PermanentError, Store, TemporaryError
from mselastic.store.lease import KeptLease
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


#: On shutdown, workers still running this long past their grace (a stop that hangs) are killed
#: before the registration is revoked (well within the unit's TimeoutStopSec at the default grace).
SHUTDOWN_MARGIN_S = 20.0
#: On a shutdown, a job's ranks get this many times the longest checkpoint they took here (when
#: longer than shutdown_grace_s), at most MAX_SHUTDOWN_GRACE_S (elasticd asks systemd for the time).
SAVE_FACTOR = 2.0
MAX_SHUTDOWN_GRACE_S = 900.0
#: On a planned shutdown, how long the final reports may take to reach etcd.
SHUTDOWN_REPORT_S = 5.0


class _StallGuard:
    """While elasticd shuts down with workers still running: a thread that kills elasticd once the
    event loop has not run the deadline check for ``limit_s`` (a hung loop cannot fence): its warm
    workers die with it (their parent-death signals), its cold ones by their shims at the fence
    deadline (within fenced_within, as the proof counts). A context manager."""

    def __init__(self, agent: "NodeAgent", limit_s: float) -> None:
        self.agent, self.limit_s = agent, limit_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-guard", daemon=True)

    def __enter__(self) -> "_StallGuard":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(0.25):
            stalled = time.monotonic() - self.agent.beat
            if stalled > self.limit_s:
                os.write(2, f"elasticd: the event loop stopped for {stalled:.1f}s while the workers take their "
                            f"shutdown grace; killing elasticd and its workers\n".encode())
                os.kill(os.getpid(), signal.SIGKILL)


class NodeIdTaken(Exception):
    """Another running elasticd is registered under this node id: this one must not start."""


class Restarting(Exception):
    """elasticd is going away (a Launch once it is, a Stop of a generation it left to its shim):
    the caller asks again, and the next elasticd answers."""


class LaunchRefused(Exception):
    """The plan is not one this agent may act on (stale, not committed, not a member)."""


class LaunchUnfit(LaunchRefused):
    """... and never will be: it does not fit this node (devices it does not have); the leader
    fails the job once this has lasted (``denied_push_fail_s``)."""


class NodeAgent:
    def __init__(self, store: Store, cfg: AgentConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.generations: dict[str, Generation] = {}
        #: Standby workers per job (see mselastic.agent.standbys.pools).
        self.standbys = WarmPools(cfg.node_id)
        self._background: set[asyncio.Task[None]] = set()
        #: Adopted warm generations whose earlier fork server is being cleaned up after them.
        self._cleaning: set[Generation] = set()
        self._swept: set[str] = set()  # jobs whose launch here swept the stale snapshot folders
        self._ended: set[str] = set()  # jobs the leader said end here (a final Stop): nothing relaunches them
        #: What this node learned of each job's timing, across its generations of one world size
        #: (agent.generation.learned: at another, each rank's share of a step is another).
        self._learned: dict[str, tuple[int, Learned]] = {}
        #: The longest checkpoint each job took here at a world size it no longer runs at (the
        #: shutdown's grace keeps it: a smaller world saves bigger shards).
        self._saves: dict[str, float] = {}
        #: This node's reports in etcd, written when a generation changes.
        self.reports = Reports(store, cfg.node_id, cfg.report_interval_s)
        #: Where this node's registration stands (core.states.NodeState; moved by :meth:`_to`).
        self.state = NodeState.STARTING
        #: Jobs whose generation was left to its shim (:meth:`hand_over`): their cgroups stay, and
        #: the lease is not revoked; and those to be left, once the others are stopped.
        self._left: set[str] = set()
        self._keeping: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self.device_health = DeviceHealth(store, cfg.node_id, cfg.device_cooldown_s, cfg.device_check,
                                          user_of=self._device_user)
        self._lease: KeptLease | None = None
        self.peers = Peers(store, cfg.node_id, cfg.lease_ttl_s, cfg.tls)
        #: How many times this agent fenced: a launch begun before a fence (it may have read a plan
        #: replaced since) is refused, even once the node is registered again.
        self._fences = 0
        #: The kills of fences under way: shielded from the cancellation of the round that decided,
        #: and waited for before the node counts as registered again.
        self._kills: set[asyncio.Task[None]] = set()
        #: Set once run() is over: the local workers are gone (or could not be killed). The
        #: deadline check runs until then, through a shutdown's grace too.
        self._closed = asyncio.Event()
        #: When the deadline check last ran (time.monotonic()): the event loop is alive.
        self.beat = time.monotonic()
        #: Launches under way, (job, generation) -> how many: Status counts them as running, so
        #: that a leader asking does not take a generation about to start here for stopped.
        self.launching: collections.Counter[tuple[str, int]] = collections.Counter()
        #: The lease the local workers run on: the registered one, or while registering again, the
        #: one before (the outage grace counts from it).
        self._cover: KeptLease | None = None
        self._ctx = dict(node=cfg.node_id)
        #: The lease expired with generations running: once registered again, keep only those that
        #: are still the committed plan of a live job.
        self._recheck = False
        #: What an earlier elasticd of this node left running (see find_left), and set once what
        #: could be adopted is (Launch and Stop wait for it: they must meet the adopted generation).
        self._found: list[adopt.Found] = []
        self._adopting: set[str] = set()
        self._adopted = asyncio.Event()
        self._adopted.set()
        #: The rule the latest round without etcd went by (logged when it changes).
        self._rule: fencing.Rule | None = None
        #: Set once the cgroups an earlier elasticd of this node left are swept (after this one
        #: registered the node id: another elasticd holding it keeps its processes); launches wait.
        self._cgroups_swept = asyncio.Event()
        if cfg.cgroups is None:
            self._cgroups_swept.set()

    # -- registration ------------------------------------------------------

    def _to(self, new: NodeState) -> None:
        """Move the node's state (core.states.NODE_TRANSITIONS; an illegal move raises
        IllegalTransition: a bug). Once DRAINING, only CLOSED: the registration's ups and downs
        while elasticd goes away change nothing of what it does; CLOSED is the end (elasticd's
        shutdown may begin once the registration has ended: an error, or an idle node's release)."""
        old = self.state
        if new is old or old is NodeState.CLOSED or (old is NodeState.DRAINING and new is not NodeState.CLOSED):
            return
        check_node_transition(old, new)
        self.state = new
        log.info("node %s -> %s", old.value, new.value, extra=self._ctx)

    async def run(self, stop: asyncio.Event, on_registered: Callable[[], None] = lambda: None) -> None:
        reporter = asyncio.create_task(self.reports.run(stop), name="reporter")
        fencer = asyncio.create_task(self._fence_loop(stop), name="fence")
        deadline = asyncio.create_task(self._deadline_loop(), name="fence-deadline")
        capper = asyncio.create_task(logcap.keep_capped(self._log_folders, self.cfg.max_log_mb << 20, stop,
                                                         self.cfg.cgroups),
                                     name="log-caps")
        watcher = asyncio.create_task(self.device_health.watch(self.cfg.device_kind, self.cfg.devices,
                                                               self.cfg.device_detect_interval_s, stop),
                                      name="devices")
        try:
            adopted = await self._adopt(stop)
            # (Kept on a lease taken over, or registered anew: either way, once registered, only
            # what etcd still has committed goes on, as after an etcd outage.)
            self._recheck = bool(adopted)
            await committed.close_stale_reports(self.store, self.cfg.node_id, stop, keep=adopted)
            while not stop.is_set():
                if self.state not in (NodeState.FENCED, NodeState.REREGISTERING):
                    self._to(NodeState.REGISTERING)
                previous, self._lease = self._lease, KeptLease(self.store, self.cfg.lease_ttl_s)
                self._cover = previous
                await self._register(self._lease, stop, fencing_by=previous)
                if stop.is_set():
                    break
                await self._killed()  # a fence decided before the registration went through ends first
                if not self._cgroups_swept.is_set() and self.cfg.cgroups is not None:
                    await self.cfg.cgroups.sweep({rel for g in self.generations.values() if not g.done.is_set()
                                                  for rel in g.groups_kept()})
                    self._cgroups_swept.set()
                self._cover = self._lease
                self._to(NodeState.HOLDING)
                on_registered()
                keeper = None
                if self._recheck:
                    self._recheck = False
                    # Alongside the hold: etcd may go away again meanwhile, and the rounds decide then.
                    keeper = asyncio.create_task(committed.keep_committed(
                        self.store, self.cfg.node_id, self.generations, self.stop, stop), name="keep-committed")
                try:
                    await self._hold(self._lease, stop)
                finally:
                    if keeper is not None:
                        keeper.cancel()
                        await asyncio.gather(keeper, return_exceptions=True)
                if stop.is_set():
                    break
                running = [g for g in self.generations.values() if not g.done.is_set()]
                if running and self.state is not NodeState.FENCED:  # (fenced: they are being killed)
                    # Not fenced so far (the rounds go on until this node is registered again), so
                    # the lease expired with etcd, not with this node. The coordinator holds the
                    # jobs of a member whose agent still runs their generation (see
                    # Presence.excused); this agent keeps what etcd still has committed.
                    log.warning("registration lease expired with etcd (it was unreachable from every node, or "
                                "reachable from this one); the workers are healthy: registering again and keeping "
                                "the committed generation(s) of %s", ", ".join(sorted(g.plan.job for g in running)),
                                extra=self._ctx)
                    self._recheck = True
                    self._to(NodeState.REREGISTERING)
        finally:
            cover = self._cover or self._lease
            guard = asyncio.create_task(self._guard_shutdown(cover), name="fence-shutdown") \
                if cover is not None else None
            try:
                if self._lease is not None:
                    await self._release_after_workers(self._lease)
            finally:
                if guard is not None:
                    guard.cancel()
                    await asyncio.gather(guard, return_exceptions=True)
                self._to(NodeState.DRAINING)
                self._to(NodeState.CLOSED)
                self._closed.set()
                for t in (reporter, fencer, deadline, capper, watcher):
                    t.cancel()
                await asyncio.gather(reporter, fencer, deadline, capper, watcher, *self._kills, return_exceptions=True)

    def _log_folders(self) -> list[logcap.Logs]:
        """What logcap.keep_capped looks at: each running generation's logs."""
        return [logcap.Logs(g.log_dir, g.user.uid if g.user else os.geteuid(),
                            g.launch.log.fileno() if g.launch.log else -1,
                            dict(self._ctx, job=g.plan.job, generation=g.plan.generation))
                for g in self.generations.values() if not g.done.is_set()]

    async def _release_after_workers(self, lease: KeptLease) -> None:
        """On shutdown, revoke the registration only once the local workers are gone (elasticd
        stops them with their grace meanwhile; the deadline check goes on until then): a leader
        that saw it gone early could replace workers still checkpointing. Not gone within their
        grace and ``SHUTDOWN_MARGIN_S``: they are killed first (a process that outlives SIGKILL
        is in the kernel and runs no more of its code). Meanwhile a thread kills elasticd, and its
        workers with it, if the event loop stops (:class:`_StallGuard`): systemd's watchdog no
        longer watches a service that is stopping."""
        wait = self.longest_shutdown_grace(self.cfg.shutdown_grace_s) + SHUTDOWN_MARGIN_S
        with _StallGuard(self, fencing.watchdog_s(self.cfg.lease_ttl_s)):
            if not await self._workers_gone(wait):
                log.error("workers still running %.0fs into the shutdown; killing them", wait, extra=self._ctx)
                await asyncio.gather(*(g.stop(0, reason="elasticd shutting down", now=True,
                                              cause=FailureCause.AGENT_SHUTDOWN)
                                       for job, g in self.generations.items()
                                       if not g.done.is_set() and job not in self._keeping))
                # (those to be left to their shims are, once the stops above have returned)
                await self._workers_gone(SHUTDOWN_MARGIN_S)
        if self.state is NodeState.DRAINING:
            await self.reports.flush(SHUTDOWN_REPORT_S)
        # (Those left are among them. Kept alive by nobody: a successor takes it over, else it expires.)
        if self._keeping:
            lease.abandon()
        else:
            await lease.release()

    async def _guard_shutdown(self, lease: KeptLease) -> None:
        """While the workers take their grace on shutdown, fencing rounds go on whenever etcd
        stops answering (the deadline check goes on anyway): a partition during a shutdown is a
        partition like any other."""
        while True:
            if lease.unreachable.is_set() or lease.lost.is_set() or lease is not self._lease:
                await self._fence_round(lease)
                await asyncio.sleep(fencing.round_s(self.cfg.lease_ttl_s))
            else:
                await first(lease.unreachable, lease.lost)

    async def _workers_gone(self, within_s: float) -> bool:
        running = [g.done.wait() for g in self.generations.values() if not g.done.is_set()]
        if running:
            try:
                await within(asyncio.gather(*running), timeout=within_s)
            except asyncio.TimeoutError:
                return False
        return True

    async def _fence_loop(self, stop: asyncio.Event) -> None:
        """Every lease TTL: a generation running here that a newer committed plan replaced, and that
        nobody stopped, is stopped as the leader's Stop would have stopped it (a planned change: at
        the step the plan names, with the job's grace period; else at once). The leader may have
        left this node out on peer evidence (its connection here dropped) while this node still
        renews its lease: no lease expiry fences it then, and its Stop cannot get through. Seen on
        two checks in a row first: the leader's own push is on its way."""
        seen: set[tuple[str, int]] = set()
        while not stop.is_set():
            await first(stop, timeout_s=self.cfg.lease_ttl_s)
            try:
                seen = await committed.stop_superseded(self.store, self.cfg.node_id, self.generations, self.stop, seen)
            except (TemporaryError, PermanentError, MalformedRecord) as e:  # etcd away: the lease decides
                log.debug("superseded-generation check skipped: %s", e, extra=self._ctx)

    async def _hold(self, lease: KeptLease, stop: asyncio.Event) -> None:
        """Return once the lease has expired (or on stop), fencing meanwhile if the rule says so:
        while no renewal goes through, a round every TTL/3 (:meth:`_fence_round`)."""
        peers = asyncio.create_task(self.peers.track(stop, self._check_registered), name="peers")
        try:
            while not stop.is_set() and not lease.lost.is_set():
                await first(lease.lost, lease.unreachable, stop)
                if lease.unreachable.is_set() and self.state is NodeState.HOLDING:
                    self._to(NodeState.UNREACHABLE)
                while lease.unreachable.is_set() and not stop.is_set() and not lease.lost.is_set():
                    await self._fence_round(lease)
                    await first(lease.lost, stop, timeout_s=fencing.round_s(self.cfg.lease_ttl_s))
                if self.state is NodeState.UNREACHABLE and not lease.unreachable.is_set() and not lease.lost.is_set():
                    self._to(NodeState.HOLDING)
        finally:
            peers.cancel()
            await asyncio.gather(peers, return_exceptions=True)

    async def _fence_rounds(self, lease: KeptLease, stop: asyncio.Event) -> None:
        """Rounds on an expired lease's terms, while this node registers again (etcd may be away
        for long: the outage grace is counted from that lease)."""
        while not stop.is_set():
            await self._fence_round(lease)
            await first(stop, timeout_s=fencing.round_s(self.cfg.lease_ttl_s))

    async def _fence_round(self, lease: KeptLease) -> None:
        """:meth:`_decide_round`; a bug in one must not end the rounds (the next may fence)."""
        try:
            await self._decide_round(lease)
        except Exception:
            log.exception("fencing round failed", extra=self._ctx)

    async def _decide_round(self, lease: KeptLease) -> None:
        """One round without etcd: ask every known peer whether it reaches etcd and read etcd once
        more ourselves (when an etcd member fails, every client misses renewals while it fails
        over, and a read may already go through), then stop the local workers if
        :func:`~mselastic.core.fencing.node_verdict` says so. A peer answers by reading etcd right
        then (its own lease keeper may not have noticed an outage yet)."""
        if not any(not g.done.is_set() for g in self.generations.values()):
            self._rule = None
            return
        answers, etcd_ok = await asyncio.gather(self.peers.ask(), self.reaches_etcd(self.peers.probe_s / 2))
        if not etcd_ok and any(answers.values()):
            # A peer read etcd just now: read once more before taking it for this node's cut. While
            # an etcd member fails over (a frozen leader, an election under way) the first reads
            # may all have gone where nothing answers yet; a cut node fails this one too, a quarter
            # of a probe later (only the deadline bounds how long a cut node trains: DESIGN).
            etcd_ok = await self.reaches_etcd(self.peers.probe_s / 2)
        verdict = fencing.node_verdict(fencing.NodeObservation(
            now=fencing.clock(), ttl_s=self.cfg.lease_ttl_s, lease_until=lease.valid_until, etcd_ok=etcd_ok,
            peers=answers))
        if verdict.act:
            await self._fence_now(lease, verdict.reason)
        elif verdict.rule is not self._rule and verdict.rule is not fencing.Rule.ETCD_ANSWERS:
            log.warning("etcd unreachable here; training goes on: %s", verdict.reason, extra=self._ctx)
        self._rule = verdict.rule

    async def _deadline_loop(self) -> None:
        """The member rule's first clause, checked four times a second rather than once a round,
        until run() is over (a shutdown's grace too): past the outage grace after the lease the
        workers run on, they stop, whatever else is seen. After a suspend or a pause of this
        process the rounds and the lease keeper wake late; this loop wakes within a quarter
        second and kills before the workers train on for long beside a generation that replaced
        them. After a fence, whatever still runs (a launch that slipped through) is killed too."""
        grace = fencing.outage_grace_s(self.cfg.lease_ttl_s)
        while not self._closed.is_set():
            await first(self._closed, timeout_s=0.25)
            self.beat = time.monotonic()
            self._extend_shims()
            cover = self._cover
            if cover is None or not cover.valid_until or any(not k.done() for k in self._kills):
                continue
            over = fencing.clock() - cover.valid_until
            if over >= grace and any(not g.done.is_set() for g in self.generations.values()):
                try:
                    await self._fence_now(cover, f"{fencing.Rule.OUTAGE_TOO_LONG.value}: {over:.1f}s past the lease")
                except Exception:  # a bug in one kill must not end the checks (the next tries again)
                    log.exception("fencing at the deadline failed", extra=self._ctx)

    def _fence_deadline(self) -> float:
        """Where the workers must be gone by, on fencing.clock(): the lease they run on plus the
        outage grace (0: no lease yet). Each generation's shim holds it too (agent.generation.shim)."""
        cover = self._cover
        if cover is None or not cover.valid_until:
            return 0.0
        return cover.valid_until + fencing.outage_grace_s(self.cfg.lease_ttl_s)

    def _extend_shims(self) -> None:
        """Move every running generation's shim deadline on to the node's (written when it moved)."""
        until = self._fence_deadline()
        for g in self.generations.values():
            if until and not g.done.is_set():
                try:
                    g.shim.extend(until)
                except OSError as e:  # (a full disk: the shim fences on the last one written)
                    log.error("the fence deadline of %s g%d not written: %s", g.plan.job, g.plan.generation, e,
                              extra=self._ctx)

    def _fenced_by_shim(self, why: str) -> None:
        """A generation's shim fenced it: its deadline, the node's, has passed (this elasticd was
        held up), so the node fences as its own check would have (the lease abandoned, every
        other generation killed, registered again), unless it has already."""
        cover = self._cover
        if cover is not None and self.state is not NodeState.FENCED:
            self._spawn(self._fence_now(cover, why.removeprefix("self-fenced: ")))

    async def _fence_now(self, lease: KeptLease, why: str) -> None:
        """Stop renewing ``lease`` (registered again once etcd answers) and kill every local
        generation at once, without the jobs' locks: a launch or a planned stop may hold one while
        it waits on etcd, and the fence must end within fencing.KILL_S. Nothing is launched here
        until the node is registered again."""
        log.error("self-fencing: %s (stopping all local workers)", why, extra=self._ctx)
        lease.abandon()
        self._to(NodeState.FENCED)
        self._fences += 1
        kill = asyncio.create_task(self._kill_all(f"self-fenced: {why}"), name="fence-kill")
        self._kills.add(kill)
        kill.add_done_callback(self._kills.discard)
        await asyncio.shield(kill)  # cancelled (the node registered meanwhile): the kill goes on

    async def _kill_all(self, reason: str) -> None:
        gens = [g for g in self.generations.values() if not g.done.is_set()]
        await asyncio.gather(*(g.stop(0, reason=reason, now=True) for g in gens))
        for g in gens:
            self._changed(g)

    async def _killed(self) -> None:
        """Wait for the fences' kills under way."""
        await asyncio.gather(*self._kills, return_exceptions=True)

    async def _check_registered(self, keys: set[str]) -> None:
        """Our key gone while our lease lives (deleted by hand, or by an elasticd that took our id):
        register again under the same lease, and say so."""
        lease, key = self._lease, self.store.keys.node(self.cfg.node_id)
        if lease is None or not lease.id or lease.lost.is_set() or key in keys:
            return
        if await self.store.create(key, self._record().to_json(), lease=lease.id):
            log.warning("this node's registration %s had disappeared; registered again", key, extra=self._ctx)

    async def reaches_etcd(self, within_s: float) -> bool:
        """Whether etcd answers this node now, within ``within_s`` (see :func:`peers.reaches_etcd`)."""
        return await reaches_etcd(self.store, within_s)

    def _record(self) -> NodeRecord:
        return NodeRecord(node_id=self.cfg.node_id, agent_address=self.cfg.agent_address, host=self.cfg.host,
                          slots=self.cfg.slots, version=__version__, device_kind=self.cfg.device_kind,
                          devices=self.cfg.devices, lease_ttl_s=self.cfg.lease_ttl_s)

    async def _register(self, lease: KeptLease, stop: asyncio.Event, fencing_by: KeptLease | None = None) -> None:
        """Register the node id under our lease, if it is free (create-if-absent); meanwhile,
        fencing rounds on the terms of the lease before it (``fencing_by``), if any.

        Taken by a running elasticd that answers as this node: :class:`NodeIdTaken` (two daemons
        with one id would evict each other). Taken by our predecessor at this same address (it
        died less than a TTL ago; the work_dir's lock says it is gone): its lease is taken over
        (agent.generation.adopt), or where that fails revoked and the id registered anew. Taken by one that
        does not answer: wait for its lease to expire."""
        key = self.store.keys.node(self.cfg.node_id)
        rounds = asyncio.create_task(self._fence_rounds(fencing_by, stop), name="fence-rounds") \
            if fencing_by is not None else None
        try:
            async for attempt in self.store.retry.reconnecting(stop):
                with attempt:
                    if not lease.id or lease.lost.is_set():
                        await lease.grant()
                    if not await self.store.create(key, self._record().to_json(), lease=lease.id):
                        holder = await self.store.get(key)
                        if holder is None or holder.lease != lease.id:
                            await self._claim(holder, lease)
        finally:
            if rounds is not None:
                rounds.cancel()
                await asyncio.gather(rounds, return_exceptions=True)
        log.info("registered %s (lease %x, ttl %ss)", key, lease.id, lease.ttl_s, extra=self._ctx)

    async def _claim(self, holder: KV | None, lease: KeptLease) -> None:
        """The node id is registered under another lease: take it over, refuse or wait (raises
        unless taken over). The previous elasticd at this same address (it died less than a TTL
        ago, or handed over): its lease is kept (by id, not revoked: the generations it left run
        on it, agent.generation.adopt) and the record rewritten (this release's); when it cannot be kept,
        it is revoked and the id registered anew."""
        if holder is None:
            raise TemporaryError("the registration changed meanwhile")
        try:
            address = NodeRecord.from_json(holder.value).agent_address
        except MalformedRecord:
            address = ""
        if address == self.cfg.agent_address:
            await lease.release()  # (the one just granted: the previous elasticd's is kept instead)
            if await lease.adopt(holder.lease):
                await self.store.put(self.store.keys.node(self.cfg.node_id), self._record().to_json(), lease=lease.id)
                log.warning("took over the registration (lease %x) the previous elasticd at %s left", lease.id,
                            address, extra=self._ctx)
                return
            log.warning("taking over the registration left by the previous elasticd at %s", address, extra=self._ctx)
            await self.store.revoke(holder.lease)
            raise TemporaryError("the previous registration was revoked; registering")
        if address and await self._answers_as_this_node(address):
            raise NodeIdTaken(f"node id {self.cfg.node_id} is already registered by a running elasticd at {address}; "
                              f"give this one another --node-id (or stop that one first)")
        log.warning("node id %s is held by an elasticd at %s that does not answer; waiting for its lease to expire",
                    self.cfg.node_id, address or "(unreadable record)", extra=self._ctx)
        raise TemporaryError("node id held by an unreachable elasticd")

    async def _answers_as_this_node(self, address: str) -> bool:
        async with self.cfg.tls.aio_channel(address) as ch:
            try:
                res = await pb_grpc.AgentStub(ch).Status(pb.AgentStatusRequest(), timeout=2.0)
            except grpc.aio.AioRpcError:
                return False
        return bool(res.node_id == self.cfg.node_id)

    # -- commands ----------------------------------------------------------

    async def launch(self, plan: Plan) -> str:
        """Run ``plan`` here (idempotent). Raises LaunchRefused for a plan not to act on."""
        if plan.member(self.cfg.node_id) is None:
            raise LaunchRefused(f"node {self.cfg.node_id} is not a member of generation {plan.generation}")
        if self.state in (NodeState.DRAINING, NodeState.CLOSED):  # (nothing new starts under an elasticd going away)
            raise Restarting(f"elasticd on node {self.cfg.node_id} is shutting down")
        key = (plan.job, plan.generation)
        self.launching[key] += 1
        try:
            if plan.job in self._adopting:  # (it must meet the generation being adopted)
                await self._adopted.wait()
            await self._cgroups_swept.wait()
            return await self._launch(plan, self._fences)
        finally:
            self.launching[key] -= 1
            if not self.launching[key]:
                del self.launching[key]

    async def _launch(self, plan: Plan, fences: int) -> str:
        """``fences``: how many times this agent had fenced when the launch began."""
        async with self._lock(plan.job):
            current = self.generations.get(plan.job)
            if current is not None and current.plan.generation >= plan.generation:
                if current.plan.generation == plan.generation:
                    return "already running"
                raise LaunchRefused(f"generation {plan.generation} is older than the running {current.plan.generation}")
            committed = await self.store.get(self.store.keys.plan(plan.job))
            if committed is None or Plan.from_json(committed.value) != plan:
                raise LaunchRefused(f"generation {plan.generation} is not the plan committed in etcd")
            spec_kv = await self.store.get(self.store.keys.spec(plan.job))
            if spec_kv is None:
                raise LaunchRefused(f"job {plan.job} has no spec in etcd")
            # A stop written after the plan was committed wins: its Stop may have reached us first.
            status_kv = await self.store.get(self.store.keys.status(plan.job))
            if status_kv is not None and (state := JobStatus.from_json(status_kv.value).state).terminal:
                raise LaunchRefused(f"job {plan.job} is {state.value}")
            spec = JobSpec.from_json(spec_kv.value)
            user = await self._job_user(plan.job)
            member = plan.member(self.cfg.node_id)
            assert member is not None  # (checked by launch)
            lasting, why = unfit(
                member, self.cfg.device_kind, self.cfg.devices,
                {g.plan.job: g.member.devices for g in self.generations.values()
                 if g.plan.job != plan.job and not g.done.is_set()})
            if why:
                raise (LaunchUnfit if lasting else LaunchRefused)(f"node {self.cfg.node_id}: {why}")
            if current is not None and not current.done.is_set():
                # Planned: the ranks checkpoint first. After a fault the collective is broken: kill.
                named = plan.stop_previous_at_step if current.plan.generation == plan.generation - 1 else 0
                await current.stop(spec.stop_grace_period_s if plan.planned else 0, named)
            # (fenced meanwhile: the plan may be replaced already)
            if self.state is NodeState.FENCED or self._fences != fences:
                raise LaunchRefused(f"node {self.cfg.node_id} fenced itself without etcd since this launch began; "
                                    f"it launches the plans committed once it is registered again")
            gen = self._generation(plan, spec, user)
            gen.prepare_snapshots()
            gen.take_standbys(self.standbys.take(plan.job, gen.launch_env.launch_key(),
                                                     gen.member.local_workers + (gen.member.node_rank == 0)))
            if self.cfg.snapshot_root and plan.job not in self._swept:
                self._swept.add(plan.job)  # once per job and elasticd: the folders of jobs long gone
                self._spawn(sweep_snapshot_folders(self.cfg.snapshot_root,
                                                   {j for j, g in self.generations.items() if not g.done.is_set()}
                                                   | {plan.job}, self.cfg.cgroups))
            self.generations[plan.job] = gen
            self._ended.discard(plan.job)  # submitted again
            await gen.start()
            self._changed(gen)
            return "launched"

    def _generation(self, plan: Plan, spec: JobSpec, user: WorkerUser | None, run_id: str = "") -> Generation:
        gen = Generation(plan, spec, self.cfg.node_id, self.cfg.work_dir, self._changed,
                         user=user, allow_env=self.cfg.allow_env, pass_env=self.cfg.pass_env,
                         snapshot_root=self.cfg.snapshot_root, batch_scheduling=self.cfg.batch_scheduling,
                         cgroups=self.cfg.cgroups, node_limits=self.cfg.job_limits,
                         heartbeat_dir=self.cfg.heartbeat_dir, fence_deadline=self._fence_deadline,
                         lease_ttl_s=self.cfg.lease_ttl_s, shim_dir=self.cfg.shim_dir, run_id=run_id,
                         namespace=self.store.keys.namespace,
                         learned=self._learned_for(plan, spec))
        gen.on_fenced = self._fenced_by_shim
        gen.on_joined = self._tell_peers_joined
        gen.on_device_fault = functools.partial(self.device_health.blame, plan.job)
        gen.check_devices = functools.partial(self.device_health.check, plan.job)
        return gen

    def _learned_for(self, plan: Plan, spec: JobSpec) -> Learned:
        """What this node learned of ``plan``'s job at its world size (anew at another)."""
        kept = self._learned.get(plan.job)
        if kept is None or kept[0] != plan.world_size:
            if kept is not None and (save := kept[1].longest(learned_rules.CHECKPOINT)):
                self._saves[plan.job] = max(save, self._saves.get(plan.job, 0.0))  # (for the shutdown's grace)
            kept = self._learned[plan.job] = (plan.world_size, Learned(spec.startup_timeout_s))
        return kept[1]

    # -- adoption (agent.generation.adopt) --------------------------------------------

    def find_left(self) -> None:
        """Before elasticd answers anyone (and with the work_dir's lock held: no other elasticd of
        this work_dir runs): the generations an earlier one left (agent.generation.adopt). Those that cannot
        be adopted are killed now; the others count as launches under way until adopted or
        killed, so that a leader asking what runs here does not take them for stopped meanwhile."""
        found = adopt.find(self.cfg.shim_dir, self.cfg.work_dir, self.cfg.node_id, self.store.keys.namespace)
        for f in found:
            if f.child is None:
                self._discard(f, f.why_not)
        self._found = [f for f in found if f.child is not None]
        self._adopting = {f.record.job for f in self._found}
        for f in self._found:
            self.launching[f.key] += 1
        if self._found:
            self._adopted.clear()

    def _discard(self, f: adopt.Found, why: str) -> None:
        left = adopt.discard(f)
        log.warning("a generation the previous elasticd left is not adopted (%s): %s", why,
                    f"processes left: {left}" if left else "stopped",
                    extra=dict(self._ctx, job=f.record.job, generation=f.record.generation))

    async def _adopt(self, stop: asyncio.Event) -> set[tuple[str, int]]:
        """Adopt each generation :meth:`find_left` found that etcd still has committed here; kill
        the others. Returns the (job, generation) adopted."""
        adopted: set[tuple[str, int]] = set()
        try:
            for f in self._found:
                try:  # (also while stopping: shut_down stops what is adopted with its grace)
                    why = await self._take_over(f)
                except Exception as e:  # (etcd away, a record gone bad, a handle refused: not adopted)
                    why = f"{type(e).__name__}: {e}"
                if why:
                    await asyncio.to_thread(self._discard, f, why)
                else:
                    adopted.add(f.key)
                self.launching[f.key] -= 1  # (only now: killed, or in self.generations)
                if self.launching[f.key] <= 0:
                    del self.launching[f.key]
        finally:
            self._found, self._adopting = [], set()
            self._adopted.set()
        return adopted

    async def _take_over(self, f: adopt.Found) -> str:
        """Adopt ``f`` if etcd still has it committed here; "" once adopted, else why not."""
        job, generation = f.key
        k = self.store.keys
        async with self._lock(job):
            plan_kv, spec_kv = await self.store.get(k.plan(job)), await self.store.get(k.spec(job))
            plan = Plan.from_json(plan_kv.value) if plan_kv is not None else None
            if plan is None or plan.generation != generation or plan.member(self.cfg.node_id) is None:
                return "it is no longer the committed plan of its job here"
            if spec_kv is None:
                return "its job is gone"
            # (A job that ended meanwhile, its Stop lost in the gap, is adopted all the same: the
            # check once registered, committed.keep_committed, stops it with its grace.)
            report_kv = await self.store.get(k.report(job, generation, self.cfg.node_id))
            report = GenerationReport.from_json(report_kv.value) if report_kv is not None else None
            if report is not None and report.state.terminal:
                return f"its report says it ended ({report.state.value})"
            if job in self.generations:
                return f"generation {self.generations[job].plan.generation} of its job runs here already"
            # Time to register and move the deadline on before its shim fences (else the node would
            # fence on its account): a TTL at least.
            if (left := shim.read_deadline(f.paths) - fencing.clock()) < self.cfg.lease_ttl_s:
                return f"its fence deadline is {left:.1f}s away, too close to take it over"
            gen = self._generation(plan, JobSpec.from_json(spec_kv.value), await self._job_user(job), f.record.run_id)
            gen.prepare_snapshots()
            assert f.child is not None
            gen.adopt(f.record, f.child, report)
            self.generations[job] = gen
            self._changed(gen)
            return ""

    async def _job_user(self, job: str) -> WorkerUser | None:
        """Who ``job``'s processes run as here: the uid of job_uids it got at submit (the same on
        every node), else the worker user. Raises LaunchRefused for a uid outside this node's range."""
        kv = await self.store.get(self.store.keys.job_uid(job))
        if kv is None:
            return self.cfg.worker_user
        uid = int(kv.value) if kv.value.isdigit() else -1
        if self.cfg.job_uids is None or uid not in self.cfg.job_uids or self.cfg.worker_user is None:
            have = f"{self.cfg.job_uids.start}-{self.cfg.job_uids.stop - 1}" if self.cfg.job_uids else "none"
            raise LaunchRefused(f"job {job} runs as uid {kv.value.decode(errors='replace')[:20]}, outside this node's "
                                f"job_uids ({have}); give every node the same job_uids")
        return self.cfg.worker_user.for_job(uid)

    async def stop(self, job: str, generation: int, grace_s: float, stop_at: int = 0, reason: str = "",
                   final: bool = False) -> list[int]:
        """Stop ``job``'s ``generation`` (0: whatever runs). ``final``: the job ends here, no relaunch
        follows: its standbys and snapshot folder go once nothing of it runs."""
        if job in self._adopting:  # (a generation being adopted is stopped once it is)
            await self._adopted.wait()
        async with self._lock(job):
            gen = self.generations.get(job)
            if gen is not None and gen.phase is Phase.LEFT:  # (the next elasticd adopts it, and stops it)
                raise Restarting(f"elasticd on node {self.cfg.node_id} is restarting; job {job} generation "
                                 f"{gen.plan.generation} runs on under its shim")
            newer = gen is not None and generation and gen.plan.generation > generation  # (resubmitted meanwhile)
            if final and not newer:
                self._ended.add(job)
                self._learned.pop(job, None)  # (a job submitted again under its name may be another)
                self._saves.pop(job, None)
                if gen is None or gen.done.is_set():
                    self._let_go(job)
            if gen is None or newer:
                return []
            if gen.plan.generation != generation:
                # A Stop of the planned successor reaching a node still running its predecessor
                # (its Launch not here yet): the step the other members stop at is in that plan.
                stop_at = await self._successor_stop_step(job, gen.plan.generation) if generation and grace_s > 0 \
                    else 0
            left = await gen.stop(grace_s, stop_at, reason,
                                  cause=FailureCause.AGENT_SHUTDOWN
                                  if self.state in (NodeState.DRAINING, NodeState.CLOSED) else FailureCause.NONE)
            self._changed(gen)
            return left

    def shutdown_grace(self, job: str, grace_s: float) -> float:
        """The grace ``job``'s ranks get when elasticd stops with its jobs: ``grace_s``
        (shutdown_grace_s), or, when longer, ``SAVE_FACTOR`` times the longest checkpoint its ranks
        took here (agent.generation.learned: a large model's save outlasts a fixed grace), at most
        ``MAX_SHUTDOWN_GRACE_S``."""
        kept = self._learned.get(job)
        longest = max((kept[1].longest(learned_rules.CHECKPOINT) if kept is not None else None) or 0.0,
                      self._saves.get(job, 0.0))
        return max(grace_s, min(SAVE_FACTOR * longest, MAX_SHUTDOWN_GRACE_S)) if longest else grace_s

    def longest_shutdown_grace(self, grace_s: float) -> float:
        """The longest :meth:`shutdown_grace` of the jobs running here (what a stop waits for)."""
        return max([grace_s, *(self.shutdown_grace(job, grace_s) for job in self.generations)])

    async def _successor_stop_step(self, job: str, generation: int) -> int:
        """The step the committed plan after ``generation`` names for it (0: none, or not known)."""
        try:
            kv = await within(self.store.get(self.store.keys.plan(job)), timeout=2.0)
            plan = Plan.from_json(kv.value) if kv is not None else None
        except (TemporaryError, PermanentError, MalformedRecord, asyncio.TimeoutError):
            return 0
        return plan.stop_previous_at_step if plan is not None and plan.generation == generation + 1 else 0

    async def hand_over(self, grace_s: float) -> None:
        """elasticd is restarting (SIGTERM): every generation that can go on without it (msrun
        under its shim: Generation.can_be_left) is left to its shim, for the next elasticd to
        adopt (agent.generation.adopt); the others are stopped as :meth:`shut_down` stops them. The
        registration lease is then let expire, not revoked: the next elasticd takes it over, and
        without one the shims fence on their deadline before a leader may replace the node.
        The others are stopped first: until then the lease is renewed and the deadlines of those
        to be left move on with it (left first, they would not, and the next elasticd could find
        them too close to their deadline to adopt)."""
        self._to(NodeState.DRAINING)
        await self._adopted.wait()  # (what is being adopted is left too, once it is)
        kept = self._keeping = {job for job, gen in self.generations.items() if gen.can_be_left()}
        await self.shut_down(grace_s, spare=kept)
        for job in kept:
            async with self._lock(job):
                gen = self.generations.get(job)
                if gen is not None and gen.can_be_left():
                    server = gen.launch.server()  # (warm: the ranks' parent, which runs on too)
                    await gen.leave()
                    self._left.add(job)
                    if server is not None:
                        await self.standbys.leave(job, server)
        await self.shut_down(grace_s)  # (those that ended or failed meanwhile)

    async def shut_down(self, grace_s: float, spare: Collection[str] = ()) -> list[int]:
        """elasticd is stopping with its jobs: stop every job's generation side by side (but those
        of ``spare`` and those left to their shims), each with the whole grace (the ranks
        checkpoint at a step first), reported as a planned stop (AGENT_SHUTDOWN: no fault of the
        job or the node). Returns the pids left."""
        self._to(NodeState.DRAINING)
        await self._adopted.wait()  # (what is being adopted is stopped too, with its grace)
        lefts = await asyncio.gather(*(self.stop(job, 0, self.shutdown_grace(job, grace_s))
                                       for job in list(self.generations) if job not in self._left and job not in spare))
        if self._background:  # (folders being removed; bounded: elasticd must stop)
            await asyncio.wait(list(self._background), timeout=SHUTDOWN_REPORT_S)
        if self.cfg.snapshot_root:
            with contextlib.suppress(OSError):
                os.rmdir(self.cfg.snapshot_root)  # only when empty: nothing kept for a job
        return [pid for left in lefts for pid in left]

    def _device_user(self, device: int) -> str:
        """The job whose generation not over here uses ``device`` ("" none)."""
        return next((job for job, gen in self.generations.items()
                     if not gen.done.is_set() and device in gen.member.devices), "")

    def _tell_peers_joined(self, gen: Generation) -> None:
        """A local rank of ``gen`` got through init(): the other members' agents may nudge their
        ranks still in it (``Agent.Nudge``; a node with one rank has no local peer to go by).
        Best effort: a peer that does not answer within a second pays MindSpore's 3 s."""
        others = [m.agent_address for m in gen.plan.members if m.node_id != self.cfg.node_id]
        if others:
            self._spawn(self.peers.nudge(others, gen.plan.job, gen.plan.generation))

    # -- standby workers ---------------------------------------------------

    def _keep_standbys(self, gen: Generation) -> None:
        """Once a generation trains here: standbys for its next relaunch, one per local rank and one
        for a scheduler (this node may be node_rank 0 next time)."""
        if self.cfg.warm_standbys:
            self.standbys.keep(gen.plan.job, gen.launch_env.launch_key(), gen.member.local_workers + 1,
                               functools.partial(self._spawn_standby, gen.launch_env),
                               functools.partial(release_standby_group, gen.launch_env))

    async def _spawn_standby(self, env: LaunchEnv, marker: str, fd: int) -> asyncio.subprocess.Process:
        """A standby (a fork server) for ``env``'s job, once the cgroups an earlier elasticd left are
        swept (an adopted generation trains before that: a pool started for it then was swept away)."""
        await self._cgroups_swept.wait()
        return await spawn_standby(env, marker, fd)

    def _running(self, job: str) -> bool:
        current = self.generations.get(job)
        return current is not None and not current.state.terminal

    def _let_go(self, job: str) -> None:
        """``job`` ended (nothing of it runs here): its standbys and its snapshot folder go now.
        Called holding the job's lock: the folder is moved aside at once, so that a launch of the
        job right after makes a new one, and removed in the background."""
        self.standbys.retire(job, True, functools.partial(self._running, job))
        if self.cfg.cgroups is not None:
            self._spawn(self._remove_job_group(job))
        if self.cfg.snapshot_root:
            path = os.path.join(self.cfg.snapshot_root, job)
            gone = os.path.join(self.cfg.snapshot_root, f".gone-{job}-{os.urandom(4).hex()}")
            try:
                os.rename(path, gone)
            except FileNotFoundError:
                return
            except OSError as e:
                log.warning("snapshot folder %s not removed: %s", path, e, extra=dict(job=job))
                return
            self._spawn(remove_snapshot_folder(gone, self.cfg.cgroups))

    async def _remove_job_group(self, job: str) -> None:
        """The job's cgroup here, once it ended: whatever is left in it (its fork server, what its
        processes started) killed, the cgroup removed; not when a generation of it runs again."""
        assert self.cfg.cgroups is not None
        async with self._lock(job):
            if not self._running(job):
                left = await self.cfg.cgroups.root.child(job).stop()
                self.cfg.cgroups.forget(job)
                if left:
                    log.error("processes of ended job %s left in its cgroup: %s", job, left, extra=self._ctx)

    async def close_cgroups(self) -> None:
        """At elasticd's exit (its workers stopped): kill what is left in this node's cgroups and
        remove them; not when this elasticd never registered the node id (another holds it)."""
        if self.cfg.cgroups is not None and self._cgroups_swept.is_set():
            await self.cfg.cgroups.close(keep={rel for job, g in self.generations.items() if job in self._left
                                               for rel in g.groups_kept()})

    def _lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    # -- reports -----------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)  # (a task nobody holds may be collected before it ends)
        task.add_done_callback(self._background.discard)

    async def _remove_snapshots_after(self, gen: Generation) -> None:
        await gen.done.wait()  # every process of it gone first
        async with self._lock(gen.plan.job):
            current = self.generations.get(gen.plan.job)
            if current is None or current is gen or current.done.is_set():
                self._let_go(gen.plan.job)

    async def _old_server_gone(self, gen: Generation) -> None:
        """An adopted warm generation is over: the fork server an earlier elasticd left for its ranks
        (it exits once they have) is past use; what is left in its cgroup is stopped, the group
        removed, and its record of ends with it."""
        await gen.done.wait()
        if self.cfg.cgroups is not None and gen.server_group:
            left = await self.cfg.cgroups.root.child(gen.server_group).stop()
            if left:
                log.warning("the old fork server's cgroup %s: pids %s left", gen.server_group, left,
                            extra=dict(self._ctx, job=gen.plan.job, generation=gen.plan.generation))
        if gen.server_exits:
            await remove_exits(gen.server_exits)
        self._cleaning.discard(gen)

    def _changed(self, gen: Generation, urgent: bool = True) -> None:
        self.reports.changed(gen, urgent)
        if urgent and gen.state.terminal and gen.adopted and (gen.server_group or gen.server_exits) \
                and gen not in self._cleaning:
            self._cleaning.add(gen)
            self._spawn(self._old_server_gone(gen))
        if urgent:
            if gen.state is GenerationState.RUNNING:
                self._keep_standbys(gen)
            elif gen.state.terminal:
                # The job is done (it succeeded, or the leader said it ends): its standbys go now and
                # its snapshots are memory nobody will read again. Otherwise a relaunch may use them.
                if gen.state is GenerationState.SUCCEEDED or gen.plan.job in self._ended:
                    self._learned.pop(gen.plan.job, None)
                    self._saves.pop(gen.plan.job, None)
                    self._spawn(self._remove_snapshots_after(gen))  # (standbys and snapshots: _let_go)
                else:
                    self.standbys.retire(gen.plan.job, False, functools.partial(self._running, gen.plan.job))

    def status(self) -> list[Generation]:
        return list(self.generations.values())
