"""Shared builders of the records tests are made of (specs, nodes, plans, reports, views): one
place to say what a small, valid one looks like."""

from __future__ import annotations

import os
from typing import Any

from mselastic.core.model import GenerationReport, JobStatus, Member, NodeRecord, Plan
from mselastic.core.planner import PortRange, make_plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import GenerationState, JobState
from mselastic.store.views import ClusterView, JobView

SPEC = JobSpec(name="job", script="/s.py", checkpoint_dir="/c", workers_per_node=2, min_nodes=1, max_nodes=2,
               max_restarts=2, global_batch_size=32)


def node(i: int, rev: int | None = None, slots: int = 2) -> NodeRecord:
    """Node ``n<i>`` at 10.0.0.<i>, registered at revision ``rev`` (default i + 1)."""
    return NodeRecord(node_id=f"n{i}", agent_address=f"10.0.0.{i}:7070", host=f"10.0.0.{i}", slots=slots,
                      version="t", create_revision=rev if rev is not None else i + 1)


def st(state: JobState = JobState.RUNNING, **kw: Any) -> JobStatus:
    return JobStatus(state, **kw)


def plan_on(*ids: int, generation: int = 1, restarts: int = 0, spec: JobSpec = SPEC) -> Plan:
    """``spec``'s plan on nodes ``n<id>``, as the planner makes it."""
    return make_plan(spec, [node(i) for i in ids], generation, restarts, "t", None, PortRange())


def local_plan(job: str = "j", generation: int = 1, workers: int | tuple[int, ...] = 2, master_port: int = 1,
               node_ids: tuple[str, ...] = ("n0",), world_size: int = 0, restart_count: int = 0) -> Plan:
    """A plan of ``workers`` ranks on each of ``node_ids`` (or one count per node), node ``k`` at
    127.0.0.<k+1> with its agent at 127.0.0.1:<k+1>, the master on the first; ``world_size``
    overrides their sum."""
    counts = workers if isinstance(workers, tuple) else (workers,) * len(node_ids)
    members = tuple(Member(n, k, counts[k], f"127.0.0.1:{k + 1}", f"127.0.0.{k + 1}") for k, n in enumerate(node_ids))
    return Plan(job=job, generation=generation, members=members, world_size=world_size or sum(counts),
                master_addr="127.0.0.1", master_port=master_port, restart_count=restart_count, reason="t")


def local_spec(folder: str, workers: int = 2, **fields: Any) -> JobSpec:
    """Job "j" whose script is ``folder``/train.py and checkpoints ``folder``/c."""
    return JobSpec(name="j", script=os.path.join(folder, "train.py"), checkpoint_dir=os.path.join(folder, "c"),
                   workers_per_node=workers, **fields)


def rep(i: int, state: GenerationState, generation: int = 1, rank: int = -1, at: float = 0.0,
        job: str = "job") -> GenerationReport:
    return GenerationReport(job=job, generation=generation, node_id=f"n{i}", state=state, failed_rank=rank,
                            reason="boom", detected_at=at)


def view(name: str, plan: Plan | None = None, state: JobState = JobState.RUNNING,
         reports: list[GenerationReport] = (), spec: JobSpec | None = SPEC) -> JobView:  # type: ignore[assignment]
    """A job as a pass sees it."""
    by_gen: dict[int, dict[str, GenerationReport]] = {}
    for r in reports:
        by_gen.setdefault(r.generation, {})[r.node_id] = r
    return JobView(name, spec=spec, plan=plan, status=JobStatus(state), reports=by_gen)


def cluster(nodes: list[NodeRecord], *jobs: JobView) -> ClusterView:
    return ClusterView(revision=1, nodes=nodes, jobs={j.name: j for j in jobs}, cordons={}, leader=None)
