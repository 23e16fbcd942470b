"""The coordinator: every elasticd campaigns; the leader runs the reconcile loop.

Level-triggered: a pass reads the whole state from etcd, asks the planner what
to do for each job, and applies that one decision. Passes run on every etcd
change under the namespace (a watch wakes the loop) and at least every
``reconcile_interval_s``, so a missed push or a lost watch event is repaired by
the next pass. Every write of a plan or a job status is one transaction that
also checks that this process still holds the leader key (its create revision
is the fencing token) and, for plans, that the stored plan is still the one the
decision was made on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from mselastic import metrics
from mselastic.agent.wire import plan_to_pb
from mselastic.core.model import Event, FailureRecord, JobStatus, LeaderRecord, Plan
from mselastic.core.planner import Action, Decision, PortRange, decide
from mselastic.core.states import JobState, check_job_transition
from mselastic.store.etcd import CHANNEL_OPTIONS, PermanentError, Store, TemporaryError
from mselastic.store.lease import Election, Term
from mselastic.store.views import JobView, read_cluster
from mselastic.tls import TlsFiles
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Fenced(Exception):
    """This process no longer holds the leader key; it must stop acting as leader."""


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    node_id: str
    control_address: str
    lease_ttl_s: int
    reconcile_interval_s: float = 1.0
    push_timeout_s: float = 10.0
    #: A member that has not reported on the current generation is pushed again after this long.
    repush_after_s: float = 3.0
    ports: PortRange = PortRange()
    tls: TlsFiles = TlsFiles()
    #: Record each running job's step in its events this often (0: never).
    progress_interval_s: float = 10.0


class Agents:
    """gRPC channels to the node agents, one per address."""

    def __init__(self, timeout_s: float, tls: TlsFiles = TlsFiles()) -> None:
        self.timeout_s = timeout_s
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> pb_grpc.AgentStub:
        if address not in self._channels:
            self._channels[address] = self.tls.aio_channel(address, options=list(CHANNEL_OPTIONS.items()))
        return pb_grpc.AgentStub(self._channels[address])

    async def launch(self, plan: Plan, only: set[str] | None = None, extra_timeout_s: float = 0.0) -> None:
        """Push ``plan`` to its members (or to the ``only`` ones); failures are logged, not raised.
        ``extra_timeout_s``: the agents first stop what runs there, with that grace period."""
        msg = pb.LaunchRequest(plan=plan_to_pb(plan))

        async def one(address: str, node_id: str) -> None:
            try:
                res = await self.stub(address).Launch(msg, timeout=self.timeout_s + extra_timeout_s)
                if not res.accepted:
                    log.warning("launch refused by %s: %s", node_id, res.message,
                                extra=dict(job=plan.job, generation=plan.generation, node=node_id))
            except grpc.aio.AioRpcError as e:
                metrics.GRPC_ERRORS.labels("Launch").inc()
                log.warning("launch push to %s failed: %s", node_id, e.details(),
                            extra=dict(job=plan.job, generation=plan.generation, node=node_id))

        await asyncio.gather(*(one(m.agent_address, m.node_id) for m in plan.members
                               if only is None or m.node_id in only))

    async def stop(self, job: str, generation: int, grace_s: float, addresses: dict[str, str]) -> dict[str, list[int]]:
        msg = pb.StopRequest(job=job, generation=generation, grace_period_s=grace_s)

        async def one(node_id: str, address: str) -> tuple[str, list[int]]:
            try:
                res = await self.stub(address).Stop(msg, timeout=grace_s + self.timeout_s)
                return node_id, list(res.leftover_pids)
            except grpc.aio.AioRpcError as e:
                metrics.GRPC_ERRORS.labels("Stop").inc()
                log.warning("stop on %s failed: %s", node_id, e.details(), extra=dict(job=job, node=node_id))
                return node_id, []

        return dict(await asyncio.gather(*(one(n, a) for n, a in addresses.items())))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


class Coordinator:
    def __init__(self, store: Store, cfg: CoordinatorConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.agents = Agents(cfg.push_timeout_s, cfg.tls)
        self._progress: dict[str, tuple[float, int]] = {}  # job -> (time, step) of the last progress event
        self._rate: dict[str, tuple[float, int]] = {}  # job -> (time, step) the step rate is measured from
        self.term: Term | None = None
        self.leading = asyncio.Event()
        self._pushed: dict[tuple[str, int, str], float] = {}
        self._wake = asyncio.Event()

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
        watcher = asyncio.create_task(self._watch(stop), name="coordinator-watch")
        try:
            while not stop.is_set() and not term.lease.lost.is_set():
                try:
                    await self.reconcile(term)
                except Fenced:
                    log.warning("deposed: the leader key is no longer ours", extra=dict(node=self.cfg.node_id))
                    return
                except TemporaryError as e:
                    metrics.ETCD_ERRORS.labels("unavailable").inc()
                    log.warning("reconcile pass skipped, etcd unavailable: %s", e)
                except PermanentError as e:
                    metrics.ETCD_ERRORS.labels("permanent").inc()
                    log.error("reconcile pass failed: %s", e)
                await self._sleep(stop, term)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _sleep(self, stop: asyncio.Event, term: Term) -> None:
        waits = [asyncio.create_task(e.wait()) for e in (self._wake, stop, term.lease.lost)]
        await asyncio.wait(waits, timeout=self.cfg.reconcile_interval_s, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        self._wake.clear()

    async def _watch(self, stop: asyncio.Event) -> None:
        """Wake the loop on every change under the namespace; re-established with backoff."""
        async for attempt in self.store.retry.reconnecting(stop):
            with attempt:
                revision, _ = await self.store.get_prefix(self.store.keys.leader)
                async for _event in self.store.watch_prefix(self.store.keys.namespace + "/", revision + 1):
                    self._wake.set()
                raise TemporaryError("watch ended")

    # -- one pass ------------------------------------------------------------

    async def reconcile(self, term: Term) -> None:
        cluster = await read_cluster(self.store)
        for view in cluster.jobs.values():
            if view.spec is None:
                if not view.status.state.terminal:
                    await self._set_status(term, view, JobState.FAILED, f"spec unreadable: {view.spec_error}")
                continue
            decision = decide(view.spec, view.status.state, view.plan, view.current_reports(), cluster.nodes,
                              self.cfg.ports, salt=cluster.revision, now=time.time(), status=view.status)
            await self._apply(term, view, decision)

    async def _apply(self, term: Term, view: JobView, d: Decision) -> None:
        assert view.spec is not None
        if d.action is Action.LAUNCH:
            assert d.plan is not None
            await self._commit_plan(term, view, d)
        elif d.action is Action.SUCCEED:
            await self._set_status(term, view, JobState.SUCCEEDED, d.reason)
        elif d.action is Action.FAIL:
            await self._set_status(term, view, JobState.FAILED, d.reason, failure=self._failure(view, d), decision=d)
            if view.plan is not None:
                await self.agents.stop(view.name, view.plan.generation, view.spec.stop_grace_period_s,
                                       {m.node_id: m.agent_address for m in view.plan.members})
        elif d.action is Action.WAIT:
            state = JobState.PENDING if view.plan is None else JobState.RESTARTING
            if (view.status.state, view.status.message) != (state, d.reason) or not view.status.waiting_since:
                await self._set_status(term, view, state, d.reason, failure=self._failure(view, d),
                                       waiting_since=view.status.waiting_since or time.time(), decision=d)
        else:
            await self._note_recovery(term, view)
            await self._note(term, view, d)
            await self._note_progress(term, view)
            await self._repush(view)

    async def _note_progress(self, term: Term, view: JobView) -> None:
        """Job gauges on every pass; a ``progress`` event every ``progress_interval_s`` (for reports)."""
        plan, step = view.plan, view.step
        if plan is None or view.status.state.terminal or step < 0:
            return
        now = time.time()
        metrics.STEP.labels(view.name).set(step)
        metrics.WORLD_SIZE.labels(view.name).set(plan.worker_num)
        metrics.GENERATION.labels(view.name).set(plan.generation)
        since, from_step = self._rate.get(view.name, (0.0, -1))
        if step < from_step or now - since > 30:
            self._rate[view.name] = (now, step)
        elif now - since >= 3 and step > from_step:
            metrics.STEP_RATE.labels(view.name).set((step - from_step) / (now - since))
            self._rate[view.name] = (now, step)
        last_at, last_step = self._progress.get(view.name, (0.0, -1))
        if self.cfg.progress_interval_s and step != last_step and now - last_at >= self.cfg.progress_interval_s:
            self._progress[view.name] = (now, step)
            k, tx = self.store.keys, self.store.tx
            event = Event(at=now, kind="progress", generation=plan.generation, message=f"step {step}", step=step,
                          world_size=plan.worker_num, loss=view.loss)
            if not await self.store.txn([tx.create(k.leader.encode()) == term.create_revision],
                                        [tx.put(k.event(view.name, time.time_ns()).encode(), event.to_json().encode())]):
                raise Fenced()

    async def _note(self, term: Term, view: JobView, d: Decision) -> None:
        """Keep the status's note (pending scale-up, idle nodes, a waiting drain) current."""
        old = view.status
        if view.plan is None or old.state.terminal or (old.note, old.scale_up_nodes, old.scale_up_since) == (
                d.note, d.scale_up_nodes, d.scale_up_since):
            return
        status = dataclasses.replace(self._status(view, old.state, old.message, old.last_failure),
                                     note=d.note, scale_up_nodes=d.scale_up_nodes, scale_up_since=d.scale_up_since)
        event = Event(at=time.time(), kind="note", generation=view.plan.generation, message=d.note or "note cleared")
        await self.write_status(term, view.name, status, event if d.note != old.note else None)

    def _failure(self, view: JobView, d: Decision) -> FailureRecord | None:
        if view.plan is None or (d.fault is None and not d.lost_nodes):
            return view.status.last_failure
        if d.fault is not None:
            return FailureRecord(generation=view.plan.generation, node_id=d.fault.node_id, rank=d.fault.failed_rank,
                                 reason=d.fault.reason, detected_at=d.fault.detected_at)
        return FailureRecord(generation=view.plan.generation, node_id=",".join(d.lost_nodes), rank=-1,
                             reason="node lost (lease expired)", detected_at=time.time())

    async def _commit_plan(self, term: Term, view: JobView, d: Decision) -> None:
        assert d.plan is not None and view.spec is not None
        k, tx = self.store.keys, self.store.tx
        failure = self._failure(view, d)
        status = self._status(view, JobState.RUNNING, d.reason, failure, d.plan, decision=d)
        event = Event(at=time.time(), kind="planned" if d.plan.planned else "generation", generation=d.plan.generation,
                      message=f"generation {d.plan.generation} on {', '.join(m.node_id for m in d.plan.members)}"
                              f" (world size {d.plan.worker_num}, master port {d.plan.master_port}): {d.reason}",
                      node_id=d.fault.node_id if d.fault else "", rank=d.fault.failed_rank if d.fault else -1,
                      detected_at=failure.detected_at if failure and (d.fault or d.lost_nodes) else 0.0)
        plan_key = k.plan(view.name).encode()
        compare = [tx.create(k.leader.encode()) == term.create_revision,
                   tx.mod(plan_key) == (view.plan_kv.mod_revision if view.plan_kv else 0)]
        ok = await self.store.txn(compare, [
            tx.put(plan_key, d.plan.to_json().encode()),
            tx.put(k.plan_history(view.name, d.plan.generation).encode(), d.plan.to_json().encode()),
            tx.put(k.status(view.name).encode(), status.to_json().encode()),
            tx.put(k.event(view.name, time.time_ns()).encode(), event.to_json().encode()),
        ])
        if not ok:
            await self._check_leader(term)
            log.info("plan changed under us; next pass decides again", extra=dict(job=view.name))
            return
        log.info("committed generation %d: %s", d.plan.generation, d.reason,
                 extra=dict(job=view.name, generation=d.plan.generation))
        metrics.GENERATIONS.labels(view.name).inc()
        if view.plan is not None:
            metrics.RESTARTS.labels(view.name, d.kind).inc()
        # Planned: every rank of the running generation is asked (SIGTERM) to checkpoint at the next
        # step; the ranks agree on that step, so the members being dropped and the ones relaunched
        # are told at the same time. After a fault there is nothing to save: kill at once.
        grace = view.spec.stop_grace_period_s if d.plan.planned else 0.0
        dropped = {m.node_id: m.agent_address for m in (view.plan.members if view.plan else ())
                   if d.plan.member(m.node_id) is None}
        self._mark_pushed(d.plan)
        stops = self.agents.stop(view.name, view.plan.generation, grace, dropped) if view.plan and dropped else None
        await asyncio.gather(self.agents.launch(d.plan, extra_timeout_s=grace), *([stops] if stops else []))

    async def _repush(self, view: JobView) -> None:
        """Push the committed plan again to members that have not reported on it (missed push)."""
        plan = view.plan
        if plan is None or view.status.state.terminal:
            return
        reports = view.current_reports()
        now = time.monotonic()
        missing = [m for m in plan.members if m.node_id not in reports
                   and now - self._pushed.get((plan.job, plan.generation, m.node_id), 0) > self.cfg.repush_after_s]
        if missing:
            self._mark_pushed(plan, {m.node_id for m in missing})
            await self.agents.launch(plan, only={m.node_id for m in missing})

    def forget(self, job: str) -> None:
        """A deleted job: drop what this leader keeps about it, and its metrics."""
        self._progress.pop(job, None)
        self._rate.pop(job, None)
        self._pushed = {k: v for k, v in self._pushed.items() if k[0] != job}
        metrics.forget_job(job)

    def _mark_pushed(self, plan: Plan, only: set[str] | None = None) -> None:
        now = time.monotonic()
        for m in plan.members:
            if only is None or m.node_id in only:
                self._pushed[(plan.job, plan.generation, m.node_id)] = now

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
        firsts = [r.first_step_at for r in reports if r.first_step_at]
        if not firsts or not f.detected_at:
            return
        recovered = dataclasses.replace(f, recover_s=round(min(firsts) - f.detected_at, 3))
        metrics.RECOVERY.labels(view.name).observe(recovered.recover_s)
        resumed = max((r.resumed_step for r in reports), default=-1)
        notes = sorted({r.resume_note for r in reports if r.resume_note})
        await self._set_status(term, view, view.status.state, view.status.message, failure=recovered,
                               event=Event(at=time.time(), kind="recovered", generation=plan.generation,
                                           message=f"generation {plan.generation} resumed from step {resumed}, "
                                                   f"first step {recovered.recover_s:.2f}s after the failure was "
                                                   f"detected" + "".join(f"; {n}" for n in notes)))

    async def _note_planned_resume(self, term: Term, view: JobView, plan: Plan) -> None:
        reports = view.current_reports().values()
        firsts = [r.first_step_at for r in reports if r.first_step_at]
        if not firsts:
            return
        resumed = max((r.resumed_step for r in reports), default=-1)
        exits = sorted({r.exit_step for r in view.reports.get(plan.generation - 1, {}).values()})
        lost = f"{exits[-1] - resumed} step(s) recomputed" if exits and exits[-1] >= 0 else "previous ranks were killed"
        status = dataclasses.replace(view.status, resumed_through=plan.generation, updated_at=time.time())
        await self.write_status(term, view.name, status, Event(
            at=time.time(), kind="resumed", generation=plan.generation,
            message=f"generation {plan.generation} resumed from step {resumed}; generation {plan.generation - 1} "
                    f"checkpointed at step(s) {exits} on request; {lost}"))

    # -- status writes -------------------------------------------------------

    def _status(self, view: JobView, state: JobState, message: str, failure: FailureRecord | None,
                plan: Plan | None = None, waiting_since: float = 0.0, decision: Decision | None = None) -> JobStatus:
        """The next status; node failure counts and quarantine come from ``decision`` when it blamed a node."""
        if state is not view.status.state:
            check_job_transition(view.status.state, state)
        plan = plan or view.plan
        old = view.status
        failures = decision.node_failures if decision and decision.node_failures is not None else old.node_failures
        quarantine = (decision.quarantined_until if decision and decision.quarantined_until is not None
                      else old.quarantined_until)
        counted = max(old.failures_counted_through, decision.failures_counted_through if decision else 0)
        # A new plan or a decision resets the note; a plain status write keeps it.
        note = (decision.note, decision.scale_up_nodes, decision.scale_up_since) if decision else (
            old.note, old.scale_up_nodes, old.scale_up_since)
        return JobStatus(state=state, generation=plan.generation if plan else 0,
                         restart_count=plan.restart_count if plan else 0, message=message,
                         last_failure=failure, updated_at=time.time(), waiting_since=waiting_since,
                         node_failures=dict(failures), quarantined_until=dict(quarantine),
                         failures_counted_through=counted, note=note[0], scale_up_nodes=note[1],
                         scale_up_since=note[2], resumed_through=old.resumed_through,
                         restart_requested=old.restart_requested)

    async def _set_status(self, term: Term, view: JobView, state: JobState, message: str,
                          failure: FailureRecord | None = None, event: Event | None = None,
                          waiting_since: float = 0.0, decision: Decision | None = None) -> None:
        failure = failure if failure is not None else view.status.last_failure
        status = self._status(view, state, message, failure, waiting_since=waiting_since, decision=decision)
        ev = event or Event(at=time.time(), kind=state.value.lower(),
                            generation=view.plan.generation if view.plan else 0, message=message)
        await self.write_status(term, view.name, status, ev)
        log.info("job %s: %s", state.value, message, extra=dict(job=view.name, generation=status.generation))

    async def write_status(self, term: Term, job: str, status: JobStatus, event: Event | None) -> None:
        k, tx = self.store.keys, self.store.tx
        ok = await self.store.txn([tx.create(k.leader.encode()) == term.create_revision], [
            tx.put(k.status(job).encode(), status.to_json().encode()),
            *([tx.put(k.event(job, time.time_ns()).encode(), event.to_json().encode())] if event else []),
        ])
        if not ok:
            raise Fenced()

    async def _check_leader(self, term: Term) -> None:
        kv = await self.store.get(self.store.keys.leader)
        if kv is None or kv.create_revision != term.create_revision:
            raise Fenced()

    def wake(self) -> None:
        self._wake.set()

