"""Reading the whole cluster's state from etcd in a few range reads, decoded and checked.

The coordinator's reconcile pass and the Control service's status both start
here, so both see the same thing. A malformed value is logged with its key and
skipped (or, for a job's own spec, reported on the job) rather than half-used.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterable, TypeVar

from mselastic.core.model import CordonRecord, DeviceCordon, GenerationReport, JobStatus, LeaderRecord, MalformedRecord, NodeRecord, Plan
from mselastic.core.spec import JobSpec, SpecError
from mselastic.core.states import JobState
from mselastic.store.etcd import KV, Store
from mselastic.store.keys import Keys

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class JobView:
    name: str
    spec: JobSpec | None = None
    spec_kv: KV | None = None
    spec_error: str = ""
    #: Malformed plan or status records: the coordinator takes no action on the job while any is.
    errors: list[str] = dataclasses.field(default_factory=list)
    plan: Plan | None = None
    plan_kv: KV | None = None
    status: JobStatus = dataclasses.field(default_factory=lambda: JobStatus(JobState.PENDING))
    status_kv: KV | None = None
    #: Reports of the current and the previous generation, by generation then node id.
    reports: dict[int, dict[str, GenerationReport]] = dataclasses.field(default_factory=dict)

    def current_reports(self) -> dict[str, GenerationReport]:
        return self.reports.get(self.plan.generation, {}) if self.plan else {}

    def running_on(self, node_id: str) -> bool:
        """The current or the previous (maybe still stopping) generation of this job starts or runs
        on the node, by its last report. Older ones cannot: a node that left them without a word
        died with its elasticd, whose successor closed them."""
        return any(not reps[node_id].state.terminal for reps in self.reports.values() if node_id in reps)

    def adopted_on(self, node_id: str) -> bool:
        """A generation of this job not over on the node was taken over there by an elasticd from an
        earlier one (a restart or crash of elasticd), by its last report."""
        return any(not reps[node_id].state.terminal and reps[node_id].adoptions
                   for reps in self.reports.values() if node_id in reps)

    @property
    def step(self) -> int:
        return max((r.step for r in self.current_reports().values()), default=-1)

    @property
    def loss(self) -> float:
        """The loss reported with the newest step (0 when none)."""
        reps = [r for r in self.current_reports().values() if r.step >= 0]
        return max(reps, key=lambda r: r.step).loss if reps else 0.0


@dataclasses.dataclass
class ClusterView:
    revision: int
    nodes: list[NodeRecord]
    jobs: dict[str, JobView]
    #: Every cordon, also of nodes not registered now.
    cordons: dict[str, CordonRecord]
    leader: LeaderRecord | None
    #: The devices set aside, by node (see mselastic.core.devices), expired ones too.
    device_cordons: dict[str, list[DeviceCordon]] = dataclasses.field(default_factory=dict)


class Decoder:
    """Decodes etcd values into records. ``memo=True`` (the informer's) remembers each key's record
    for its mod revision, so a pass over a cached cluster decodes only what changed."""

    def __init__(self, memo: bool = False) -> None:
        self._memo: dict[str, tuple[int, Any, Exception | None]] | None = {} if memo else None

    def __call__(self, kv: KV, decode: Callable[[bytes], T]) -> T:
        if self._memo is None:
            return decode(kv.value)
        hit = self._memo.get(kv.key)
        if hit is None or hit[0] != kv.mod_revision:
            try:
                hit = (kv.mod_revision, decode(kv.value), None)
            except (MalformedRecord, SpecError, ValueError) as e:
                hit = (kv.mod_revision, None, e)
            self._memo[kv.key] = hit
        if hit[2] is not None:
            # A new exception each time: re-raising the cached one would grow its traceback (and
            # keep every pass's frames alive) for as long as the record stays malformed.
            raise type(hit[2])(*hit[2].args)
        return hit[1]

    def forget(self, key: str) -> None:
        if self._memo is not None:
            self._memo.pop(key, None)


@dataclasses.dataclass
class Raw:
    """The etcd values a cluster view is made of, as read at ``revision``. ``reports(job, g)``
    gives the reports of one generation of a job."""

    revision: int
    nodes: Iterable[KV]
    cordons: Iterable[KV]
    leader: KV | None
    jobs: Iterable[KV]
    reports: Callable[[str, int], Iterable[KV]]


async def read_cluster(store: Store, job: str = "") -> ClusterView:
    """The cluster as stored now (a few range reads; the Control service's view)."""
    keys = store.keys
    revision, node_kvs = await store.get_prefix(keys.nodes)
    _, cordon_kvs = await store.get_prefix(keys.cordons)
    leader_kv = await store.get(keys.leader)
    _, job_kvs = await store.get_prefix(keys.job(job) if job else keys.jobs)
    decode = Decoder(memo=True)  # for this read only: the plans are decoded here and in assemble
    plans = {}
    for kv in job_kvs:
        parsed = keys.parse_job_key(kv.key)
        if parsed is not None and parsed[1] == "plan":
            try:
                plans[parsed[0]] = decode(kv, Plan.from_json).generation
            except MalformedRecord:
                continue
    reports: dict[tuple[str, int], list[KV]] = {}
    for name, generation in plans.items():
        start = keys.reports(name, max(generation - 1, 0))
        for kv in await store.get_range(start, keys.range_end(keys.reports(name, generation))):
            parsed_report = keys.parse_report_key(kv.key)
            if parsed_report is not None:
                reports.setdefault(parsed_report[:2], []).append(kv)
    raw = Raw(revision, node_kvs, cordon_kvs, leader_kv, job_kvs, lambda j, g: reports.get((j, g), []))
    return assemble(keys, raw, decode)


def assemble(keys: Keys, raw: Raw, decode: Decoder) -> ClusterView:
    """Decode and check what was read into a ClusterView; malformed values are logged and skipped
    (or, for a job's own records, kept on the job as its error)."""
    nodes = []
    for kv in raw.nodes:
        try:
            # The create revision orders the nodes (oldest first); a re-created key has a new mod
            # revision too, so the decoded record is remembered with it.
            nodes.append(decode(kv, functools.partial(NodeRecord.from_json, create_revision=kv.create_revision)))
        except MalformedRecord as e:
            log.error("skipping malformed node record %s: %s", kv.key, e)
    cordons: dict[str, CordonRecord] = {}
    device_cordons: dict[str, list[DeviceCordon]] = {}
    for kv in raw.cordons:
        try:
            if "/" in kv.key[len(keys.cordons):]:  # (cordons/<node>/devices/<id>)
                rec_d = decode(kv, DeviceCordon.from_json)
                device_cordons.setdefault(rec_d.node_id, []).append(rec_d)
                continue
            rec_c = decode(kv, CordonRecord.from_json)
            cordons[rec_c.node_id] = rec_c
        except MalformedRecord as e:
            log.error("skipping malformed cordon record %s: %s", kv.key, e)
    nodes = [dataclasses.replace(n, cordoned=True, draining=cordons[n.node_id].drain) if n.node_id in cordons else n
             for n in nodes]
    nodes.sort(key=lambda n: n.node_id)
    leader = None
    if raw.leader is not None:
        try:
            leader = decode(raw.leader, LeaderRecord.from_json)
        except MalformedRecord as e:
            log.error("malformed leader record: %s", e)
    jobs: dict[str, JobView] = {}
    for kv in raw.jobs:
        parsed = keys.parse_job_key(kv.key)
        if parsed is None:
            continue
        name, rest = parsed
        view = jobs.setdefault(name, JobView(name))
        try:
            _apply(view, rest, kv, decode)
        except (MalformedRecord, SpecError, ValueError) as e:
            log.error("malformed value at %s: %s", kv.key, e, extra={"job": name})
            if rest == "spec":
                view.spec_error = str(e)
            else:
                view.errors.append(f"malformed {rest} record ({kv.key}): {e}")
    jobs = {k: v for k, v in jobs.items() if v.spec or v.spec_error}

    def submitted(v: JobView) -> tuple[int, str]:
        return (v.spec_kv.create_revision if v.spec_kv else 0, v.name)
    jobs = dict(sorted(jobs.items(), key=lambda item: submitted(item[1])))  # first come, first served
    for view in jobs.values():
        if view.plan is None:
            continue
        for generation in (view.plan.generation - 1, view.plan.generation):
            for kv in raw.reports(view.name, generation):
                parsed_report = keys.parse_report_key(kv.key)
                if parsed_report is None:
                    continue
                try:
                    view.reports.setdefault(generation, {})[parsed_report[2]] = decode(kv, GenerationReport.from_json)
                except (MalformedRecord, ValueError) as e:
                    log.error("malformed value at %s: %s", kv.key, e, extra={"job": view.name})
    return ClusterView(raw.revision, nodes, jobs, cordons, leader, device_cordons)


def _apply(view: JobView, rest: str, kv: KV, decode: Decoder) -> None:
    if rest == "spec":
        view.spec, view.spec_kv = decode(kv, JobSpec.from_json), kv
    elif rest == "plan":
        view.plan, view.plan_kv = decode(kv, Plan.from_json), kv
    elif rest == "status":
        view.status, view.status_kv = decode(kv, JobStatus.from_json), kv
