"""The planner: membership + job spec + history -> what the coordinator does next.

A pure function (no etcd, no clock, no processes), so every rule is a row in a
table test. The coordinator reads the state from etcd, calls :func:`decide`,
and applies the one :class:`Decision` it returns.

Rules, in order:
1. A job in a terminal state: nothing.
2. No plan yet: launch generation 1 on the oldest eligible nodes (up to
   ``max_nodes``) once ``min_nodes`` are there; otherwise wait.
3. A member reported FAILED, or a member's registration is gone (lease expired):
   relaunch as generation g+1 on the surviving members in their old order, new
   nodes appended; if restarts are exhausted, fail the job.
4. Every member reported SUCCEEDED: the job succeeded.
5. Waiting for ``min_nodes`` for longer than ``min_nodes_timeout_s``: fail the job.

Quarantine (Horovod's blacklist with cooldown): each fault is blamed on a node
(the one whose rank failed first, or a lost one); a node blamed
``quarantine_after_failures`` times is left out of new generations for
``quarantine_cooldown_s``, doubled with every further failure (at most an hour).
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from typing import Iterable, Mapping

from mselastic.core.model import GenerationReport, Member, NodeRecord, Plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import GenerationState, JobState

#: Ports msrun's workers (8118-12213) and servers (12214-16309) use; never a master_port.
RESERVED_PORTS = range(8118, 16310)
MAX_QUARANTINE_S = 3600.0


@dataclasses.dataclass(frozen=True)
class PortRange:
    """Master ports are chosen from [start, start + span); outside RESERVED_PORTS."""

    start: int = 20000
    span: int = 5000

    def __post_init__(self) -> None:
        end = self.start + self.span
        if self.span <= 1 or self.start < 1024 or end > 65536:
            raise ValueError(f"master port range {self.start}+{self.span} must lie within 1024..65535")
        if self.start < RESERVED_PORTS.stop and end > RESERVED_PORTS.start:
            raise ValueError(f"master port range {self.start}+{self.span} overlaps msrun's 8118-16309")


class Action(enum.Enum):
    NOTHING = "NOTHING"
    WAIT = "WAIT"  # not enough nodes; job stays PENDING/RESTARTING
    LAUNCH = "LAUNCH"  # commit ``plan`` as the next generation
    SUCCEED = "SUCCEED"
    FAIL = "FAIL"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    plan: Plan | None = None
    #: For a relaunch or failure caused by a fault: the report that showed it.
    fault: GenerationReport | None = None
    #: For a relaunch caused by lost nodes.
    lost_nodes: tuple[str, ...] = ()
    #: Updated failure counts and quarantine when this decision blames a node (None: unchanged).
    node_failures: Mapping[str, int] | None = None
    quarantined_until: Mapping[str, float] | None = None
    #: The generation whose failure these counts include.
    failures_counted_through: int = 0


def master_port(job: str, generation: int, previous: int | None, ports: PortRange, salt: int = 0) -> int:
    """A per-generation port: spread by a hash, never the previous generation's.

    ``salt`` (the coordinator passes the etcd revision it decided at) keeps two
    clusters on one host from choosing the same port for a job of the same name.
    """
    port = ports.start + zlib.crc32(f"{job}/{generation}/{salt}".encode()) % ports.span
    if port == previous:
        port = ports.start + (port - ports.start + 1) % ports.span
    return port


def eligible(nodes: Iterable[NodeRecord], spec: JobSpec) -> list[NodeRecord]:
    """Nodes that can run the job, oldest registration first."""
    ok = [n for n in nodes if n.slots >= spec.workers_per_node and not n.cordoned]
    return sorted(ok, key=lambda n: (n.create_revision, n.node_id))


def make_plan(
    spec: JobSpec, nodes: list[NodeRecord], generation: int, restart_count: int, reason: str,
    previous_port: int | None, ports: PortRange, salt: int = 0,
) -> Plan:
    members = tuple(
        Member(node_id=n.node_id, node_rank=i, local_workers=spec.workers_per_node,
               agent_address=n.agent_address, host=n.host)
        for i, n in enumerate(nodes)
    )
    return Plan(
        job=spec.name, generation=generation, members=members,
        worker_num=spec.workers_per_node * len(members), master_addr=members[0].host,
        master_port=master_port(spec.name, generation, previous_port, ports, salt),
        restart_count=restart_count, reason=reason,
    )


def decide(
    spec: JobSpec,
    state: JobState,
    plan: Plan | None,
    reports: Mapping[str, GenerationReport],
    nodes: Iterable[NodeRecord],
    ports: PortRange = PortRange(),
    salt: int = 0,
    now: float = 0.0,
    waiting_since: float = 0.0,
    node_failures: Mapping[str, int] | None = None,
    quarantined_until: Mapping[str, float] | None = None,
    failures_counted_through: int = 0,
) -> Decision:
    """The next step for one job. ``reports`` are the current generation's, by node id;
    ``salt`` varies the master port (see :func:`master_port`); ``now`` and
    ``waiting_since`` (0: not waiting) time the wait for ``min_nodes``;
    ``node_failures`` / ``quarantined_until`` are the job's node history, which already
    includes the failures of generations up to ``failures_counted_through``."""
    if state.terminal:
        return Decision(Action.NOTHING)
    quarantine = {n: t for n, t in (quarantined_until or {}).items() if t > now}
    alive = [n for n in eligible(nodes, spec) if n.node_id not in quarantine]

    def wait(reason: str, blame: Decision = Decision(Action.WAIT)) -> Decision:
        """WAIT, or FAIL once the wait has lasted too long; ``blame`` carries the fault history."""
        if waiting_since and now - waiting_since > spec.min_nodes_timeout_s:
            reason = f"{reason} for more than min_nodes_timeout_s={spec.min_nodes_timeout_s:g}"
            return dataclasses.replace(blame, action=Action.FAIL, reason=reason)
        return dataclasses.replace(blame, action=Action.WAIT, reason=reason)

    if plan is None:
        if len(alive) < spec.min_nodes:
            return wait(f"waiting for nodes: {len(alive)} of min_nodes={spec.min_nodes}")
        chosen = alive[: spec.max_nodes]
        return Decision(Action.LAUNCH, "initial launch",
                        make_plan(spec, chosen, 1, 0, "initial launch", None, ports, salt))

    current = [r for r in reports.values() if r.generation == plan.generation]
    failed = sorted((r for r in current if r.state is GenerationState.FAILED),
                    key=lambda r: (r.detected_at or float("inf"), r.node_id))
    alive_ids = {n.node_id for n in alive}
    lost = tuple(m.node_id for m in plan.members if m.node_id not in alive_ids)

    if not failed and not lost:
        done = {r.node_id for r in current if r.state is GenerationState.SUCCEEDED}
        if done >= {m.node_id for m in plan.members}:
            return Decision(Action.SUCCEED, f"generation {plan.generation} finished on every node")
        return Decision(Action.NOTHING)

    fault = failed[0] if failed else None
    if fault is not None:
        rank = f"rank {fault.failed_rank}" if fault.failed_rank >= 0 else "msrun"
        reason = f"{rank} on node {fault.node_id} failed: {fault.reason}"
    else:
        reason = f"node(s) lost: {', '.join(lost)}"
    failures = dict(node_failures or {})
    if failures_counted_through < plan.generation:  # a waiting job sees the same fault on every pass
        for blamed in ([fault.node_id] if fault is not None else list(lost)):
            failures[blamed] = failures.get(blamed, 0) + 1
            over = failures[blamed] - spec.quarantine_after_failures
            if over >= 0:
                quarantine[blamed] = now + min(MAX_QUARANTINE_S, spec.quarantine_cooldown_s * 2 ** over)
    blame = Decision(Action.FAIL, reason, fault=fault, lost_nodes=lost, node_failures=failures,
                     quarantined_until=quarantine, failures_counted_through=plan.generation)
    if plan.restart_count >= spec.max_restarts:
        return dataclasses.replace(blame, reason=f"restarts exhausted (max_restarts={spec.max_restarts}); last: {reason}")

    alive = [n for n in alive if n.node_id not in quarantine]
    by_id = {n.node_id: n for n in alive}
    survivors = [by_id[m.node_id] for m in plan.members if m.node_id in by_id]
    newcomers = [n for n in alive if n.node_id not in {s.node_id for s in survivors}]
    chosen = (survivors + newcomers)[: spec.max_nodes]
    if quarantine.keys() & {m.node_id for m in plan.members}:
        reason += f"; quarantined: {', '.join(sorted(quarantine.keys() & {m.node_id for m in plan.members}))}"
    if len(chosen) < spec.min_nodes:
        return wait(f"{reason}; waiting for nodes: {len(chosen)} of min_nodes={spec.min_nodes}", blame)
    nxt = make_plan(spec, chosen, plan.generation + 1, plan.restart_count + 1, reason, plan.master_port, ports, salt)
    return dataclasses.replace(blame, action=Action.LAUNCH, reason=reason, plan=nxt)
