"""The Control gRPC service elasticctl talks to.

Status, Events and Describe are answered by any elasticd (they read etcd). Submit,
StopJob, Cordon, Restart, Scale and DeleteJob change state and are answered by the leader only;
any other elasticd refuses with FAILED_PRECONDITION and the leader's address, which
elasticctl follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

import grpc
import tenacity

from mselastic.core.waits import within
from mselastic.wire import abort, failure_cause_to_pb, job_state_to_pb, plan_to_pb
from mselastic.agent.containment.jobfiles import READ_S, Unreadable, bounded, read_small
from mselastic.core import retries
from mselastic.core.contract import LATEST_CHECKPOINT
from mselastic.core.devices import format_ids
from mselastic.core.kinds import EventKind
from mselastic.core.model import (CordonRecord, DeletedJob, DeviceCordon, Event, GenerationReport, JobStatus,
                                  LeaderRecord, MalformedRecord, NodeRecord, Plan)
from mselastic.core.spec import MAX_SECONDS, JobSpec, SpecError, forbidden_env
from mselastic.core.states import JobState
from mselastic.core.status import next_status
from mselastic.daemon.admission import slots_held
from mselastic.daemon.coordinator import Coordinator
from mselastic.daemon.history import STOPPED_NOTE
from mselastic.daemon.statuses import Fenced
from mselastic.store.lease import Term
from mselastic.store.etcd import PermanentError, Store, TemporaryError
from mselastic.store.keys import BadName
from mselastic.store.views import ClusterView, JobView, read_cluster
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

NOT_LEADER_PREFIX = "not the leader; leader is "
#: How long a stop waits for the leader's note of the step its ranks checkpointed at.
STOP_NOTE_WAIT_S = 5.0


def checkpointed_step(checkpoint_dir: str, job: str) -> int | None:
    """The step of ``job``'s newest checkpoint in ``checkpoint_dir`` as this node sees it (shared
    storage); None when there is none, it is another job's, or it cannot be read here."""
    try:  # (the job's files: read as jobfiles reads them, see there)
        latest = json.loads(read_small(os.path.join(checkpoint_dir, LATEST_CHECKPOINT)))
        if latest.get("job", "") not in ("", job):
            return None
        manifest = latest["manifest"]
        step = json.loads(read_small(os.path.join(checkpoint_dir, os.path.basename(str(manifest)))))["step"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def devices_pb(node: NodeRecord, users: dict[tuple[str, int], tuple[str, int]],
               cluster: ClusterView) -> list[pb.DeviceInfo]:
    """Each device of ``node``: the job and rank on it, and whether it is set aside (until when)."""
    now = time.time()
    aside = {c.device: c for c in cluster.device_cordons.get(node.node_id, []) if c.held(now)}
    out = []
    for d in node.devices:
        job, rank = users.get((node.node_id, d), ("", -1))
        c = aside.get(d)
        out.append(pb.DeviceInfo(id=d, job=job, rank=rank, unhealthy=c.reason if c else "",
                                 unhealthy_since=c.since if c else 0.0, unhealthy_until=c.until if c else 0.0))
    return out


def device_users(cluster: ClusterView) -> dict[tuple[str, int], tuple[str, int]]:
    """(node, device id) → (job, global rank) for the devices the current plans of the jobs not
    over give their ranks (local rank i of a member on its devices[i])."""
    users: dict[tuple[str, int], tuple[str, int]] = {}
    for name, view in cluster.jobs.items():
        if view.plan is None or view.status.state.terminal:
            continue
        first = 0
        for m in view.plan.members:
            for i, d in enumerate(m.devices):
                users[(m.node_id, d)] = (name, first + i)
            first += m.local_workers
    return users


class Conflict(Exception):
    """The job's status changed between our read and our compare-and-set."""


class CheckpointSteps:
    """The step of each job's newest checkpoint, for the jobs table: read off the event loop with
    :func:`bounded` (a budget of :attr:`STUCK` stuck reads of its own: the launches' and submits'
    stay whole), a read reused for :attr:`KEEP_S`, none started while the last one's thread is
    still stuck in the kernel, and a poll never waiting more than :attr:`WAIT_S` for one (shared
    storage may hang: the table then shows what the agents reported; a read that finishes serves
    the next polls)."""

    KEEP_S = 5.0
    WAIT_S = 0.3
    MAX_JOBS = 4096
    STUCK = 4

    def __init__(self) -> None:
        self._reads: dict[tuple[str, str], tuple[float, asyncio.Task[int | None]]] = {}
        self._reading: set[tuple[str, str]] = set()  # (their thread still runs, answered or not)
        self._slots = threading.BoundedSemaphore(self.STUCK)

    async def get(self, job: str, checkpoint_dir: str) -> int | None:
        key, now = (job, checkpoint_dir), time.monotonic()
        held = self._reads.get(key)
        if held is None or (held[1].done() and now - held[0] > self.KEEP_S and key not in self._reading):
            if len(self._reads) >= self.MAX_JOBS:  # (jobs come and go: the oldest answers go)
                for old in sorted(self._reads, key=lambda k: self._reads[k][0])[:self.MAX_JOBS // 4]:
                    if self._reads[old][1].done():
                        del self._reads[old]
            held = self._reads[key] = (now, asyncio.create_task(self._read(job, checkpoint_dir)))
        try:
            return await within(asyncio.shield(held[1]), self.WAIT_S)
        except asyncio.TimeoutError:
            return None

    async def _read(self, job: str, checkpoint_dir: str) -> int | None:
        key = (job, checkpoint_dir)

        def read() -> int | None:  # (in its thread: marked while it runs, stuck or not)
            self._reading.add(key)
            try:
                return checkpointed_step(checkpoint_dir, job)
            finally:
                self._reading.discard(key)  # (a set's add and discard are atomic under the GIL)

        try:
            return await bounded(read, within_s=READ_S, slots=self._slots)
        except Unreadable:
            return None
        except Exception as e:  # noqa: BLE001 - the job's bytes (deeply nested JSON: RecursionError)
            log.debug("checkpointed step of %s not read: %s", job, e, extra=dict(job=job))
            return None


async def shown_step(view: JobView, steps: CheckpointSteps) -> int:
    """The newest step the current generation reported; while it starts (no step yet), the step it
    resumes from (its ranks', once they say), else its newest checkpoint (``steps``), else where
    the previous generation got to. Between generations the table should not read 0, as if the
    progress were lost."""
    if view.step >= 0 or view.plan is None or view.spec is None:
        return view.step
    resumed = max((r.resumed_step for r in view.current_reports().values()), default=-1)
    if resumed >= 0:
        return resumed
    checkpointed = None if view.status.state.terminal else await steps.get(view.name, view.spec.checkpoint_dir)
    if checkpointed is not None:
        return checkpointed
    before = view.reports.get(view.plan.generation - 1, {}).values()
    return max((r.exit_step if r.exit_step >= 0 else r.step for r in before), default=-1)


async def job_to_pb(view: JobView, steps: CheckpointSteps) -> pb.JobStatus:
    st = view.status
    msg = pb.JobStatus(job=view.name, state=job_state_to_pb(st.state), generation=st.generation,
                       restart_count=st.restart_count, step=await shown_step(view, steps),
                       message=st.message or view.spec_error,
                       total_steps=view.spec.total_steps if view.spec else 0, note=st.note, loss=view.loss)
    if view.spec is not None:
        msg.min_nodes, msg.max_nodes = view.spec.min_nodes, view.spec.max_nodes
        msg.global_batch_size = view.spec.global_batch_size
    if view.plan is not None:
        msg.world_size = view.plan.world_size
        msg.members.extend(plan_to_pb(view.plan).members)
    now = time.time()
    msg.quarantined.extend(pb.Quarantine(node_id=n, failures=st.node_failures.get(n, 0), until=t)
                           for n, t in sorted(st.quarantined_until.items()) if t > now)
    f = st.last_failure
    if f is not None:
        msg.last_failure.CopyFrom(pb.Failure(generation=f.generation, node_id=f.node_id, rank=f.rank,
                                             reason=f.reason, detected_at=f.detected_at, recover_s=f.recover_s,
                                             cause=failure_cause_to_pb(f.cause)))
    return msg


#: What Describe shows for the value of each variable of a job's env.
HIDDEN = "(hidden)"


def unseen_paths(spec: JobSpec) -> str:
    """What of the spec's paths this node cannot see ("" when it sees them): the script, and the
    checkpoint_dir or, when it is still to be made, the folder it would be made in."""
    if not os.path.isfile(spec.script):
        return f"script {spec.script} " + ("is a folder" if os.path.isdir(spec.script) else "does not exist")
    path = os.path.normpath(spec.checkpoint_dir)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"checkpoint_dir {spec.checkpoint_dir} cannot be a folder: {path} is not one"
    return ""


class _UidTaken(Exception):
    """The uid a submit chose was taken by another submit meanwhile."""


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _store_errors_mapped(handler: Handler) -> Handler:
    """``handler`` (an RPC of the Control service) with the store's errors answered as gRPC codes:
    etcd not answering (TemporaryError) UNAVAILABLE, a write refused as this leader is deposed
    (Fenced) FAILED_PRECONDITION; each says to retry, and nothing was written."""
    @functools.wraps(handler)
    async def mapped(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except TemporaryError as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {e}")
        except Fenced:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "leadership lost; retry")
    return mapped  # type: ignore[return-value]


def store_errors_mapped(cls: type) -> type:
    """Every RPC of ``cls`` (the generated servicer's methods it defines) through :func:`_store_errors_mapped`."""
    rpcs = {name for name in vars(pb_grpc.ControlServicer) if not name.startswith("_")}
    for name in rpcs & set(vars(cls)):
        setattr(cls, name, _store_errors_mapped(getattr(cls, name)))
    return cls


@store_errors_mapped
class ControlService(pb_grpc.ControlServicer):
    def __init__(self, store: Store, coordinator: Coordinator, allow_env: frozenset[str] = frozenset(),
                 etcd_members: Callable[[], list[tuple[str, str, str]]] = list, job_uids: range | None = None) -> None:
        self.store = store
        #: The uids jobs get one of each at submit (elasticd's job_uids; None: they run as worker_user).
        self.job_uids = job_uids
        self.coordinator = coordinator
        #: (endpoint, version, warning) of each etcd member, as this elasticd last read them.
        self.etcd_members = etcd_members
        #: Loader and interpreter variables a job's env may set anyway (elasticd's allow_env).
        self.allow_env = allow_env
        #: The jobs' checkpointed steps, as the jobs table shows them while a generation starts.
        self.steps = CheckpointSteps()

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        try:
            cluster = await read_cluster(self.store, request.job)
        except BadName as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.job and request.job not in cluster.jobs:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"no job named {request.job!r}")
        leader = cluster.leader.node_id if cluster.leader else ""
        used: dict[str, int] = {}
        for held in slots_held(cluster, {}).values():
            for node_id, n in held.items():
                used[node_id] = used.get(node_id, 0) + n
        users = device_users(cluster)
        return pb.StatusResponse(
            jobs=list(await asyncio.gather(*(job_to_pb(v, self.steps) for _, v in sorted(cluster.jobs.items())))),
            nodes=[pb.NodeInfo(node_id=n.node_id, agent_address=n.agent_address, slots=n.slots, version=n.version,
                               leader=n.node_id == leader, cordoned=n.cordoned, draining=n.draining,
                               used_slots=used.get(n.node_id, 0),
                               running_jobs=sorted(j for j, v in cluster.jobs.items() if v.running_on(n.node_id)),
                               adopted_jobs=sorted(j for j, v in cluster.jobs.items() if v.adopted_on(n.node_id)),
                               device_kind=n.device_kind, devices=devices_pb(n, users, cluster),
                               lease_ttl_s=n.lease_ttl_s)
                   for n in cluster.nodes],
            leader=leader,
            etcd=[pb.EtcdMember(endpoint=e, version=v, warning=w) for e, v, w in self.etcd_members()])

    async def _range_warning(self, spec: JobSpec) -> str:
        """Why ``spec`` cannot start on the nodes registered now ("" when it can, or etcd cannot say)."""
        try:
            cluster = await read_cluster(self.store, spec.name)
        except (TemporaryError, PermanentError):  # the job is submitted: a warning must not fail that
            return ""
        fit = [n for n in cluster.nodes if n.slots >= spec.workers_per_node and not n.cordoned]
        if len(fit) >= spec.min_nodes:
            return ""
        return (f"only {len(fit)} registered node(s) can run it (not cordoned, at least workers_per_node="
                f"{spec.workers_per_node} slots), min_nodes={spec.min_nodes}: it waits for more nodes, and fails after "
                f"min_nodes_timeout_s={spec.min_nodes_timeout_s:g}")

    async def _require_leader(self, context: grpc.aio.ServicerContext) -> None:
        if self.coordinator.term is None:
            kv = await self.store.get(self.store.keys.leader)
            where = LeaderRecord.from_json(kv.value).control_address if kv else "(none elected yet)"
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, NOT_LEADER_PREFIX + where)

    async def Submit(self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext) -> pb.SubmitResponse:
        try:
            spec = JobSpec.from_json(request.spec_json)
        except SpecError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        refused = forbidden_env(dict(spec.env), self.allow_env)
        if refused:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"env: {', '.join(refused)} may not be set by a job (loader and interpreter variables run "
                        f"code in every worker; which devices a rank sees is the node's); an admin may allow them "
                        f"with elasticd's allow_env")
        await self._require_leader(context)
        warnings = await self._check_fit_and_dir(spec, request.force, context)
        k, tx = self.store.keys, self.store.tx
        try:
            # A job deleted under this name: continue after its last generation (agents refuse older ones).
            deleted = await self.store.get(k.deleted(spec.name))
            floor = DeletedJob.from_json(deleted.value).generation if deleted else 0
        except MalformedRecord as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"bad record at {k.deleted(spec.name)}: {e}")
        status = JobStatus(JobState.PENDING, generation=floor, message="submitted", updated_at=time.time())
        event = Event(at=time.time(), kind=EventKind.SUBMITTED, generation=0,
                      message=f"job {spec.name} submitted" + (f" (a job of this name ran generations up to {floor}; "
                                                              f"this one continues after them)" if floor else ""))
        # The checkpoint_dir is claimed in the same transaction: two submits at once with one
        # directory cannot both pass the check above.
        claim = k.checkpoint_dir(spec.checkpoint_dir)
        try:
            unchanged = tx.mod(k.deleted(spec.name).encode()) == (deleted.mod_revision if deleted else 0)
            async for attempt in retries.on_conflict(_UidTaken, attempts=5):
                with attempt:
                    uid_compare, uid_puts = await self._uid_for(spec.name, context)
                    ok = await self.store.txn([tx.create(k.spec(spec.name).encode()) == 0, unchanged,
                                               tx.create(claim.encode()) == 0, *uid_compare], [
                        tx.put(k.spec(spec.name).encode(), spec.to_json().encode()),
                        tx.put(k.status(spec.name).encode(), status.to_json().encode()),
                        tx.put(k.event(spec.name, time.time_ns()).encode(), event.to_json().encode()),
                        tx.put(claim.encode(), spec.name.encode()), *uid_puts,
                    ])
                    if not ok and uid_compare and await self.store.get(k.spec(spec.name)) is None \
                            and await self.store.get(claim) is None:
                        raise _UidTaken()  # (another submit took the uid meanwhile: choose again)
            holder = None if ok else await self.store.get(claim)
        except _UidTaken:
            await abort(context, grpc.StatusCode.ABORTED, "other jobs were submitted meanwhile; submit again")
        if not ok and holder is not None and holder.value.decode(errors="replace") != spec.name:
            other = holder.value.decode(errors="replace")
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"checkpoint_dir {spec.checkpoint_dir} belongs to job {other}; give this job its own "
                        f"(or elasticctl delete {other} first)")
        if not ok:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, f"job {spec.name!r} already exists")
        self.coordinator.wake()
        warnings.append(await self._range_warning(spec))
        return pb.SubmitResponse(job=spec.name, warning="; ".join(filter(None, warnings)))

    async def _uid_for(self, job: str, context: grpc.aio.ServicerContext) -> tuple[list[Any], list[Any]]:
        """The compare and the puts that give ``job`` a uid of ``job_uids`` in the submit's
        transaction (none without job_uids): the one this job name had before (its files on disk
        are that uid's), else one no job ever had, else one a deleted job released (then that
        job's files left on disk become this one's: said in docs/security.md)."""
        if self.job_uids is None:
            return [], []
        k, tx = self.store.keys, self.store.tx
        _, kvs = await self.store.get_prefix(k.uid_claims)
        claims = {int(name): kv for kv in kvs if (name := kv.key.rpartition("/")[2]).isdigit()}
        held = {uid: kv.value.decode(errors="replace") for uid, kv in claims.items()}
        uid = next((u for u, holder in held.items() if holder == f"-{job}" and u in self.job_uids), None)
        if uid is None:
            uid = next((u for u in self.job_uids if u not in held), None)
        if uid is None:
            uid = next((u for u in self.job_uids if held.get(u, "").startswith("-")), None)
        if uid is None:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"every uid of job_uids ({self.job_uids.start}-{self.job_uids.stop - 1}) belongs to a job; "
                        f"delete jobs that are over, or widen job_uids on every node")
        key = k.uid_claim(uid).encode()
        compare = tx.value(key) == claims[uid].value if uid in claims else tx.create(key) == 0
        return [compare], [tx.put(key, job.encode()), tx.put(k.job_uid(job).encode(), str(uid).encode())]

    async def _check_fit_and_dir(self, spec: JobSpec, force: bool, context: grpc.aio.ServicerContext) -> list[str]:
        """Refuse a job no registered node is large enough for, a checkpoint_dir another job uses,
        one already past total_steps (unless ``force``), and, when this node is the only one, a
        script or checkpoint_dir it cannot see. Returns what to warn about."""
        others = await read_cluster(self.store)
        workers = [n for n in others.nodes if n.slots > 0]  # (a node of 0 slots only coordinates)
        if workers and all(n.slots < spec.workers_per_node for n in workers):
            sizes = ", ".join(f"{n.node_id}: {n.slots}" for n in workers[:8])
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"workers_per_node={spec.workers_per_node} is more than any registered node's slots ({sizes}"
                        f"{', ...' if len(workers) > 8 else ''}); lower it, or start a node with more slots")
        mine = os.path.normpath(spec.checkpoint_dir)
        sharing = sorted(v.name for v in others.jobs.values() if v.spec is not None and v.name != spec.name
                         and os.path.normpath(v.spec.checkpoint_dir) == mine)
        if sharing:  # it would resume the other job's weights, and the two would overwrite each other
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"checkpoint_dir {spec.checkpoint_dir} belongs to job {sharing[0]}; give this job its own "
                        f"(or elasticctl delete {sharing[0]} first)")
        # Shared storage may hang, and the job's files are the job's: read as jobfiles reads them.
        try:
            unseen = await bounded(unseen_paths, spec)
        except Unreadable as e:
            return [f"the script and checkpoint_dir could not be looked at on node {self.coordinator.cfg.node_id}: {e}"]
        here = self.coordinator.cfg.node_id
        if unseen and [n.node_id for n in workers] == [here]:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"{unseen} on node {here}, the cluster's only node: fix the path in the spec (a relative "
                        f"path resolves against the spec file's folder)")
        warnings = [f"{unseen} on node {here}: every node must have it at that path, or the job's launch there "
                    f"fails"] if unseen else []
        try:
            reached = await bounded(checkpointed_step, spec.checkpoint_dir, spec.name)
        except Unreadable as e:
            return [*warnings, f"checkpoint_dir {spec.checkpoint_dir} could not be read: {e}"]
        if reached is not None and reached >= spec.total_steps:
            if not force:
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                            f"checkpoint_dir {spec.checkpoint_dir} holds a checkpoint of step {reached}, at or past "
                            f"total_steps={spec.total_steps}: this job is done there. To train further, raise "
                            f"total_steps; to start over, give another checkpoint_dir or empty this one "
                            f"(--force submits it anyway: it ends at once)")
            warnings.append(f"it resumes at step {reached} of {spec.total_steps}: it ends at once, without training")
        return warnings

    async def _change_status(self, job: str, context: grpc.aio.ServicerContext,
                             change: Callable[[JobView], tuple[JobStatus, Event] | None]) -> JobView:
        """Read the job, ``change`` its status, compare-and-set it on the revision read; when the
        coordinator wrote meanwhile, read again and retry (a stop or restart is never lost, nor
        undone by a pass that decided on the older status). Returns the job as written."""
        term = await self._term(context)
        try:
            async for attempt in retries.on_conflict(Conflict, attempts=20, jitter_s=(0.01, 0.1)):
                with attempt:
                    view = await self._job(job, context)
                    changed = change(view)
                    if changed is None:
                        return view
                    if not await self.coordinator.write_status(term, view, *changed):
                        raise Conflict()
                    return view
        except Conflict:
            await abort(context, grpc.StatusCode.ABORTED, f"job {job} kept changing under this request; retry")
        except Fenced:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "leadership lost; retry")
        raise AssertionError("unreachable")

    async def StopJob(self, request: pb.StopJobRequest, context: grpc.aio.ServicerContext) -> pb.StopJobResponse:
        if not 0 <= request.grace_period_s <= MAX_SECONDS:  # NaN fails too
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"grace_period_s must be a number of seconds in 0..{MAX_SECONDS:.0f}")
        await self._require_leader(context)

        def stopped(view: JobView) -> tuple[JobStatus, Event] | None:
            if view.status.state.terminal:
                return None
            status = next_status(view.status, JobState.STOPPED, "stopped by operator", time.time(), plan=view.plan,
                                 failure=view.status.last_failure)
            return dataclasses.replace(status, stop_grace_s=request.grace_period_s), Event(
                at=time.time(), kind=EventKind.STOPPED, generation=view.status.generation, message="stopped by operator")
        before = await self._job(request.job, context)
        if before.status.state.terminal:
            return pb.StopJobResponse(state=job_state_to_pb(before.status.state))
        # The intent is recorded (STOPPED, with the grace asked for); the reconcile pass it wakes
        # stops the members (Applier._restop), and sends the Stop again where it was lost. The
        # plan as of the status written: a relaunch committed before the stop is stopped too, and
        # one the coordinator decided before it can no longer commit (its status compare fails).
        view = await self._change_status(request.job, context, stopped)
        self.coordinator.queue.forget(request.job)  # (an operator's stop is acted on now, whatever the backoff)
        if view.plan is not None and view.status.state is JobState.STOPPED:
            grace = request.grace_period_s or (view.spec.stop_grace_period_s if view.spec else 10.0)
            await self._stop_noted(request.job, view.plan.generation, [m.node_id for m in view.plan.members], grace)
        return pb.StopJobResponse(state=job_state_to_pb(view.status.state))

    async def _stop_noted(self, job: str, generation: int, nodes: list[str], grace_s: float) -> None:
        """The leader's pass stops the ranks of ``generation`` on ``nodes`` (they checkpoint within
        ``grace_s``); their reports reach etcd and the leader notes the step they checkpointed at
        (the step a resubmission resumes from) a moment later. Wait for that note: while a report
        says the generation still runs, the grace and a push's timeout (the job's worker may be
        busy) at most; once none does, ``STOP_NOTE_WAIT_S`` more at most (a member that never
        reported on it has nothing to note). So that what the stop's caller reads next (events,
        status) says it; not at all when a member's node is not registered (it never reports) or
        etcd does not answer (the stop is recorded: only the note is late)."""
        within_s = grace_s + self.coordinator.cfg.push_timeout_s + STOP_NOTE_WAIT_S  # (a pass may be pushing)
        over_since: list[float] = []

        async def unnoted() -> bool:
            kv = await self.store.get(self.store.keys.status(job))
            if kv is None:
                return False
            status = JobStatus.from_json(kv.value)
            if status.state is not JobState.STOPPED or STOPPED_NOTE in status.message:
                return False
            _, kvs = await self.store.get_prefix(self.store.keys.reports(job, generation))
            if any(not GenerationReport.from_json(r.value).state.terminal for r in kvs):
                over_since.clear()
                return True
            over_since[:] = over_since or [time.monotonic()]
            return time.monotonic() - over_since[0] < STOP_NOTE_WAIT_S

        async def noted() -> None:
            registered = await asyncio.gather(*(self.store.get(self.store.keys.node(n)) for n in nodes))
            if all(registered):
                await retries.polling(within_s, every_s=0.1)(unnoted)

        self.coordinator.wake()
        with contextlib.suppress(tenacity.RetryError, asyncio.TimeoutError, TemporaryError, PermanentError,
                                 MalformedRecord):
            await within(noted(), within_s + 1)

    async def Cordon(self, request: pb.CordonRequest, context: grpc.aio.ServicerContext) -> pb.CordonResponse:
        """cordon / drain write ``cordons/<node>`` (kept across re-registration); uncordon deletes it.
        The reconcile pass does the rest: a draining member gets a planned relaunch without it."""
        if request.drain and not request.cordon:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "drain implies cordon")
        if request.remove and (request.cordon or request.HasField("device")):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a node is removed whole, not cordoned")
        await self._require_leader(context)
        k = self.store.keys
        try:
            key = k.cordon(request.node_id)
            cluster = await read_cluster(self.store)
            known = {n.node_id for n in cluster.nodes} | set(cluster.cordons) | set(cluster.device_cordons)
            if request.node_id not in known:
                await abort(context, grpc.StatusCode.NOT_FOUND,
                            f"no node named {request.node_id!r} is registered (see elasticctl status)")
            if request.HasField("device"):
                return await self._cordon_device(request, cluster, context)
            if request.remove:
                return await self._remove_node(request.node_id, cluster, context)
            term = await self._term(context)
            if request.cordon:
                rec = CordonRecord(request.node_id, request.drain, time.time(), request.reason)
                written = await term.put(self.store, key, rec.to_json())
            else:
                written = await term.delete(self.store, key)
            if not written:
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "leadership lost; retry")
        except BadName as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("node %s %s", request.node_id,
                 "draining" if request.drain else "cordoned" if request.cordon else "uncordoned",
                 extra=dict(node=request.node_id))
        self.coordinator.wake()
        return pb.CordonResponse(node_id=request.node_id, cordoned=request.cordon, draining=request.drain)

    async def _remove_node(self, node_id: str, cluster: ClusterView,
                           context: grpc.aio.ServicerContext) -> pb.CordonResponse:
        """A node taken out of the cluster for good: its cordon and its devices' records go (its
        registration went with its lease). Refused while it is registered, or while a job that has
        not ended still has it in its current plan (the leader replans without it first)."""
        if any(n.node_id == node_id for n in cluster.nodes):
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"node {node_id} is registered: stop its elasticd for good first (on it: systemctl "
                        f"disable --now elasticd; elasticctl drain {node_id} before, to move its jobs off it)")
        counting = sorted(v.name for v in cluster.jobs.values()
                          if v.plan is not None and not v.status.state.terminal
                          and any(m.node_id == node_id for m in v.plan.members))
        if counting:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"job(s) {', '.join(counting)} still have node {node_id} in their current plan: wait until "
                        f"the leader has relaunched them without it (elasticctl describe job {counting[0]})")
        k = self.store.keys
        devices = k.device_cordons(node_id)
        records = (node_id in cluster.cordons) + len(cluster.device_cordons.get(node_id, []))
        term = await self._term(context)
        if not await self.store.txn([term.guard(self.store), self.store.tx.create(k.node(node_id).encode()) == 0], [
                self.store.tx.delete(k.cordon(node_id).encode()),
                self.store.tx.delete(devices.encode(), range_end=k.range_end(devices).encode())]):
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"leadership lost, or node {node_id} registered meanwhile; nothing removed (retry)")
        log.info("node %s removed: %d record(s) deleted", node_id, records, extra=dict(node=node_id))
        self.coordinator.wake()
        return pb.CordonResponse(node_id=node_id, removed=records)

    async def _cordon_device(self, request: pb.CordonRequest, cluster: ClusterView,
                             context: grpc.aio.ServicerContext) -> pb.CordonResponse:
        """cordon / uncordon one device of a node (``--device``): set aside by hand, or back."""
        node = next((n for n in cluster.nodes if n.node_id == request.node_id), None)
        recorded = {c.device for c in cluster.device_cordons.get(request.node_id, [])}
        stale = not request.cordon and request.device in recorded  # (a node gone, a device it lists no more)
        if not stale and (node is None or request.device not in node.devices):
            have = format_ids(node.devices) if node is not None and node.devices else "none"
            await abort(context, grpc.StatusCode.NOT_FOUND,
                        f"node {request.node_id} has no device {request.device} (its devices: {have})")
        if request.drain:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a device is cordoned or uncordoned, not drained")
        key = self.store.keys.device_cordon(request.node_id, request.device)
        term = await self._term(context)
        if request.cordon:
            rec = DeviceCordon(request.node_id, request.device, request.reason or "cordoned by an operator",
                               time.time())
            written = await term.put(self.store, key, rec.to_json())
        else:
            written = await term.delete(self.store, key)
        if not written:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "leadership lost; retry")
        log.info("node %s device %d %s", request.node_id, request.device,
                 "cordoned" if request.cordon else "uncordoned", extra=dict(node=request.node_id))
        self.coordinator.wake()
        return pb.CordonResponse(node_id=request.node_id, cordoned=request.cordon)

    async def _job(self, job: str, context: grpc.aio.ServicerContext) -> JobView:
        return (await self._cluster_and_job(job, context))[1]

    async def _cluster_and_job(self, job: str, context: grpc.aio.ServicerContext) -> tuple[ClusterView, JobView]:
        """The cluster as read for ``job`` (nodes, leader, that job), or the call aborted."""
        try:
            cluster = await read_cluster(self.store, job)
        except BadName as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        view = cluster.jobs.get(job)
        if view is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"no job named {job!r} (see elasticctl jobs)")
        assert view is not None
        return cluster, view

    async def Events(self, request: pb.EventsRequest, context: grpc.aio.ServicerContext) -> pb.EventsResponse:
        await self._job(request.job, context)
        _, kvs = await self.store.get_prefix(self.store.keys.events(request.job))
        events: list[pb.Event] = []
        for kv in kvs:
            try:
                ev = Event.from_json(kv.value)
            except MalformedRecord as err:
                log.error("skipping malformed event %s: %s", kv.key, err, extra=dict(job=request.job))
                continue
            events.append(pb.Event(at=ev.at, kind=ev.kind.value, generation=ev.generation, message=ev.message,
                                   node_id=ev.node_id, rank=ev.rank, detected_at=ev.detected_at, step=ev.step,
                                   world_size=ev.world_size, loss=ev.loss))
        events.sort(key=lambda e: e.at)
        return pb.EventsResponse(events=events)

    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        view = await self._job(request.job, context)
        _, kvs = await self.store.get_prefix(self.store.keys.plans(request.job))
        plans = []
        for kv in kvs:
            try:
                plans.append(Plan.from_json(kv.value))
            except MalformedRecord as err:
                log.error("skipping malformed plan %s: %s", kv.key, err, extra=dict(job=request.job))
        # The env's values are not shown (tokens, passwords): the names are.
        spec = dataclasses.replace(view.spec, env={k: HIDDEN for k in view.spec.env}) if view.spec else None
        return pb.DescribeResponse(status=await job_to_pb(view, self.steps), spec_json=spec.to_json() if spec else "",
                                   plans=[plan_to_pb(p) for p in sorted(plans, key=lambda p: p.generation)])

    async def _term(self, context: grpc.aio.ServicerContext) -> Term:
        term = self.coordinator.term
        if term is None:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "leadership lost; retry")
        return term

    async def DeleteJob(self, request: pb.DeleteJobRequest,
                        context: grpc.aio.ServicerContext) -> pb.DeleteJobResponse:
        """Remove a finished job's records; what it wrote (checkpoints, worker logs) stays."""
        await self._require_leader(context)
        cluster, view = await self._cluster_and_job(request.job, context)
        if not view.status.state.terminal:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"job {view.name} is {view.status.state.value}; stop it first (elasticctl stop {view.name})")
        busy = sorted(n.node_id for n in cluster.nodes if view.running_on(n.node_id))
        if busy:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"job {view.name} is still stopping on {', '.join(busy)}; retry in a moment")
        k, tx = self.store.keys, self.store.tx
        last = max(view.status.generation, view.plan.generation if view.plan else 0)
        prefixes = [k.job(view.name), k.job_reports(view.name), k.plans(view.name), k.events(view.name)]
        spec_kv = await self.store.get(k.spec(view.name))
        uid_kv = await self.store.get(k.job_uid(view.name))
        # Its uid released in the same transaction, remembered for the name (see _uid_for).
        release = [tx.put(k.uid_claim(int(uid_kv.value)).encode(), f"-{view.name}".encode())] \
            if uid_kv is not None and uid_kv.value.isdigit() else []
        ok = await self.store.txn(
            [(await self._term(context)).guard(self.store),
             tx.mod(k.spec(view.name).encode()) == (spec_kv.mod_revision if spec_kv else 0),
             *([tx.mod(k.job_uid(view.name).encode()) == uid_kv.mod_revision] if uid_kv and release else [])],
            [*(tx.delete(p.encode(), k.range_end(p).encode()) for p in prefixes), *release,
             tx.put(k.deleted(view.name).encode(), DeletedJob(last, time.time()).to_json().encode())])
        if not ok:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"job {view.name} changed meanwhile; retry")
        if view.spec is not None:  # the directory is free for another job now (its files stay)
            claim = k.checkpoint_dir(view.spec.checkpoint_dir).encode()
            with contextlib.suppress(TemporaryError):
                await self.store.txn([tx.value(claim) == view.name.encode()], [tx.delete(claim)])
        self.coordinator.forget(view.name)
        self.coordinator.wake()  # (its pass tells every node the job is gone: Coordinator._gone)
        log.info("job %s deleted after generation %d", view.name, last, extra=dict(job=view.name, generation=last))
        return pb.DeleteJobResponse(generation=last)

    async def Restart(self, request: pb.RestartRequest, context: grpc.aio.ServicerContext) -> pb.RestartResponse:
        """A planned relaunch of a running job: checkpoint a few steps ahead (the step the leader names), resume there."""
        await self._require_leader(context)
        refused: list[str] = []

        def requested(view: JobView) -> tuple[JobStatus, Event] | None:
            if view.status.state is not JobState.RUNNING or view.plan is None:
                refused.append(f"job {request.job} is {view.status.state.value}; only a RUNNING job can be restarted")
                return None
            status = dataclasses.replace(view.status, restart_requested=view.plan.generation, updated_at=time.time())
            return status, Event(at=time.time(), kind=EventKind.RESTART, generation=view.plan.generation,
                                 message="restart requested by operator")
        view = await self._change_status(request.job, context, requested)
        if refused:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, refused[0])
        assert view.plan is not None
        self.coordinator.wake()
        return pb.RestartResponse(generation=view.plan.generation + 1)

    async def Scale(self, request: pb.ScaleRequest, context: grpc.aio.ServicerContext) -> pb.ScaleResponse:
        """Change the job's node range; the spec is checked as at submit (valid world sizes)."""
        await self._require_leader(context)
        view = await self._job(request.job, context)
        if view.spec is None or view.status.state.terminal:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"job {request.job} is {view.status.state.value}; nothing to scale")
        assert view.spec is not None
        data = view.spec.to_dict()
        data["min_nodes"] = request.min_nodes or view.spec.min_nodes
        data["max_nodes"] = request.max_nodes or view.spec.max_nodes
        try:
            spec = JobSpec.from_dict(data)
        except SpecError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        k, tx = self.store.keys, self.store.tx
        term = await self._term(context)
        event = Event(at=time.time(), kind=EventKind.SCALED, generation=view.status.generation,
                      message=f"node range {view.spec.min_nodes}..{view.spec.max_nodes} -> "
                              f"{spec.min_nodes}..{spec.max_nodes} by operator")
        spec_key = k.spec(view.name).encode()
        kv = await self.store.get(k.spec(view.name))
        ok = await self.store.txn([term.guard(self.store),
                                   tx.mod(spec_key) == (kv.mod_revision if kv else 0)], [
            tx.put(spec_key, spec.to_json().encode()),
            tx.put(k.event(view.name, time.time_ns()).encode(), event.to_json().encode())])
        if not ok:
            await abort(context, grpc.StatusCode.ABORTED, "the job changed meanwhile; retry")
        self.coordinator.wake()
        return pb.ScaleResponse(min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
                                warning=await self._range_warning(spec))
