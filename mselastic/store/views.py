"""Reading the whole cluster's state from etcd in a few range reads, decoded and checked.

The coordinator's reconcile pass and the Control service's status both start
here, so both see the same thing. A malformed value is logged with its key and
skipped (or, for a job's own spec, reported on the job) rather than half-used.
"""

from __future__ import annotations

import dataclasses
import logging

from mselastic.core.model import CordonRecord, GenerationReport, JobStatus, LeaderRecord, MalformedRecord, NodeRecord, Plan
from mselastic.core.spec import JobSpec, SpecError
from mselastic.core.states import JobState
from mselastic.store.etcd import KV, Store

log = logging.getLogger(__name__)


@dataclasses.dataclass
class JobView:
    name: str
    spec: JobSpec | None = None
    spec_error: str = ""
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


async def read_cluster(store: Store, job: str = "") -> ClusterView:
    keys = store.keys
    revision, node_kvs = await store.get_prefix(keys.nodes)
    nodes = []
    for kv in node_kvs:
        try:
            nodes.append(NodeRecord.from_json(kv.value, kv.create_revision))
        except MalformedRecord as e:
            log.error("skipping malformed node record %s: %s", kv.key, e)
    _, cordon_kvs = await store.get_prefix(keys.cordons)
    cordons: dict[str, CordonRecord] = {}
    for kv in cordon_kvs:
        try:
            rec = CordonRecord.from_json(kv.value)
            cordons[rec.node_id] = rec
        except MalformedRecord as e:
            log.error("skipping malformed cordon record %s: %s", kv.key, e)
    nodes = [dataclasses.replace(n, cordoned=True, draining=cordons[n.node_id].drain) if n.node_id in cordons else n
             for n in nodes]
    leader_kv = await store.get(keys.leader)
    leader = None
    if leader_kv is not None:
        try:
            leader = LeaderRecord.from_json(leader_kv.value)
        except MalformedRecord as e:
            log.error("malformed leader record: %s", e)
    _, job_kvs = await store.get_prefix(keys.job(job) if job else keys.jobs)
    jobs: dict[str, JobView] = {}
    for kv in job_kvs:
        parsed = keys.parse_job_key(kv.key)
        if parsed is None:
            continue
        name, rest = parsed
        view = jobs.setdefault(name, JobView(name))
        try:
            _apply(view, rest, kv)
        except (MalformedRecord, SpecError, ValueError) as e:
            log.error("malformed value at %s: %s", kv.key, e, extra={"job": name})
            if rest == "spec":
                view.spec_error = str(e)
    jobs = {k: v for k, v in jobs.items() if v.spec or v.spec_error}
    for view in jobs.values():
        if view.plan is not None:
            await _read_reports(store, view, view.plan.generation)
    return ClusterView(revision, nodes, jobs, cordons, leader)


async def _read_reports(store: Store, view: JobView, generation: int) -> None:
    """The reports of ``generation`` and the one before it (one range read)."""
    keys = store.keys
    start, end = keys.reports(view.name, max(generation - 1, 0)), keys.range_end(keys.reports(view.name, generation))
    for kv in await store.get_range(start, end):
        parsed = keys.parse_report_key(kv.key)
        if parsed is None:
            continue
        try:
            view.reports.setdefault(parsed[1], {})[parsed[2]] = GenerationReport.from_json(kv.value)
        except (MalformedRecord, ValueError) as e:
            log.error("malformed value at %s: %s", kv.key, e, extra={"job": view.name})


def _apply(view: JobView, rest: str, kv: KV) -> None:
    if rest == "spec":
        view.spec = JobSpec.from_json(kv.value)
    elif rest == "plan":
        view.plan, view.plan_kv = Plan.from_json(kv.value), kv
    elif rest == "status":
        view.status, view.status_kv = JobStatus.from_json(kv.value), kv
