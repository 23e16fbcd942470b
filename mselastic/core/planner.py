"""The planner: membership + job spec + history -> what the coordinator does next.

A pure function (no etcd, no clock, no processes), so every rule is a row in a
table test. The coordinator reads the state from etcd, calls :func:`decide`,
and applies the one :class:`Decision` it returns.

Rules, in order:
1. A job in a terminal state: nothing.
2. No plan yet: launch generation 1 on the oldest eligible nodes, as many as
   give the largest valid world size (see :mod:`mselastic.core.elastic`) within
   ``min_nodes``..``max_nodes``; otherwise wait. Nodes left out are named in the reason.
3. A member reported FAILED (or STOPPED: its ranks exited on a SIGTERM the
   coordinator did not send), or a member's registration is gone (lease expired):
   relaunch as generation g+1 on the surviving members in their old order, new
   nodes appended, cut to a valid size; if restarts are exhausted, fail the job.
4. Every member reported SUCCEEDED: the job succeeded.
5. Waiting for ``min_nodes`` for longer than ``min_nodes_timeout_s``: fail the job.
6. A healthy generation asked to restart (``elasticctl restart``), with more members
   than ``max_nodes`` (``elasticctl scale``), with a member being drained, or with
   joined nodes that give a larger valid world size and no further join for
   ``scale_up_settle_s``: a *planned* relaunch (the ranks checkpoint on SIGTERM; not
   counted as a restart).

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

from mselastic.core.model import AGENT_RESTARTED, GenerationReport, JobStatus, Member, NodeRecord, Plan
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
    #: For LAUNCH: why, one of mselastic.metrics.REASONS (a label, so a fixed set).
    kind: str = ""
    #: For NOTHING: what the job waits for or leaves out, for its status.
    note: str = ""
    scale_up_nodes: tuple[str, ...] = ()
    scale_up_since: float = 0.0


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
    """Nodes a new generation may use, oldest registration first."""
    ok = [n for n in nodes if n.slots >= spec.workers_per_node and not n.cordoned]
    return sorted(ok, key=lambda n: (n.create_revision, n.node_id))


def make_plan(
    spec: JobSpec, nodes: list[NodeRecord], generation: int, restart_count: int, reason: str,
    previous_port: int | None, ports: PortRange, salt: int = 0, planned: bool = False,
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
        restart_count=restart_count, reason=reason, planned=planned,
    )


def idle_note(spec: JobSpec, idle: list[NodeRecord], used: int) -> str:
    """Why nodes that could run the job are left out of a generation of ``used`` nodes."""
    if not idle:
        return ""
    why = (f"max_nodes={spec.max_nodes}" if used >= spec.max_nodes else
           f"global_batch_size={spec.global_batch_size} needs a world size in {spec.valid_world_sizes()}")
    return f"node(s) {', '.join(n.node_id for n in idle)} idle: {why}"


def decide(
    spec: JobSpec,
    state: JobState,
    plan: Plan | None,
    reports: Mapping[str, GenerationReport],
    nodes: Iterable[NodeRecord],
    ports: PortRange = PortRange(),
    salt: int = 0,
    now: float = 0.0,
    status: JobStatus | None = None,
) -> Decision:
    """The next step for one job. ``reports`` are the current generation's, by node id;
    ``salt`` varies the master port (see :func:`master_port`); ``now`` times the waits
    against ``status`` (the job's status as stored: waiting since, node failure counts
    and quarantine, the pending scale-up)."""
    if state.terminal:
        return Decision(Action.NOTHING)
    st = status or JobStatus(state)
    nodes = list(nodes)
    quarantine = {n: t for n, t in st.quarantined_until.items() if t > now}
    alive = [n for n in eligible(nodes, spec) if n.node_id not in quarantine]

    def wait(reason: str, blame: Decision = Decision(Action.WAIT)) -> Decision:
        """WAIT, or FAIL once the wait has lasted too long; ``blame`` carries the fault history."""
        if st.waiting_since and now - st.waiting_since > spec.min_nodes_timeout_s:
            reason = f"{reason} for more than min_nodes_timeout_s={spec.min_nodes_timeout_s:g}"
            return dataclasses.replace(blame, action=Action.FAIL, reason=reason)
        return dataclasses.replace(blame, action=Action.WAIT, reason=reason)

    if plan is None:
        n = spec.node_count(len(alive))
        if not n:
            return wait(_short(spec, len(alive)))
        reason = "; ".join(filter(None, ["initial launch", idle_note(spec, alive[n:], n)]))
        # 1, or after the last generation of a deleted job of the same name (status.generation).
        first = make_plan(spec, alive[:n], st.generation + 1, 0, reason, None, ports, salt)
        return Decision(Action.LAUNCH, reason, first, kind="initial")

    current = [r for r in reports.values() if r.generation == plan.generation]
    # STOPPED on a generation that is still the plan: its ranks exited on a SIGTERM nobody here sent.
    failed = sorted((r for r in current if r.state in (GenerationState.FAILED, GenerationState.STOPPED)),
                    key=lambda r: (r.detected_at or float("inf"), r.node_id))
    registered = {n.node_id for n in nodes if n.slots >= spec.workers_per_node}
    lost = tuple(m.node_id for m in plan.members if m.node_id not in registered)

    if not failed and not lost:
        done = {r.node_id for r in current if r.state is GenerationState.SUCCEEDED}
        if done >= {m.node_id for m in plan.members}:
            return Decision(Action.SUCCEED, f"generation {plan.generation} finished on every node")
        return _planned(spec, plan, current, nodes, alive, ports, salt, now, st)

    fault = failed[0] if failed else None
    if fault is not None:
        if fault.state is GenerationState.STOPPED or fault.reason == AGENT_RESTARTED:
            reason = f"on node {fault.node_id}, {fault.reason}"
        else:
            rank = f"rank {fault.failed_rank}" if fault.failed_rank >= 0 else "msrun"
            reason = f"{rank} on node {fault.node_id} failed: {fault.reason}"
    else:
        reason = f"node(s) lost: {', '.join(lost)}"
    failures = dict(st.node_failures)
    if st.failures_counted_through < plan.generation:  # a waiting job sees the same fault on every pass
        for blamed in ([fault.node_id] if fault is not None else list(lost)):
            failures[blamed] = failures.get(blamed, 0) + 1
            over = failures[blamed] - spec.quarantine_after_failures
            if over >= 0:
                quarantine[blamed] = now + min(MAX_QUARANTINE_S, spec.quarantine_cooldown_s * 2 ** over)
    blame = Decision(Action.FAIL, reason, fault=fault, lost_nodes=lost, node_failures=failures,
                     quarantined_until=quarantine, failures_counted_through=plan.generation, kind=_kind(fault))
    if plan.restart_count >= spec.max_restarts:
        return dataclasses.replace(blame, reason=f"restarts exhausted (max_restarts={spec.max_restarts}); last: {reason}")

    alive = [n for n in alive if n.node_id not in quarantine]
    pool = _keep_order(plan, alive)
    if quarantine.keys() & {m.node_id for m in plan.members}:
        reason += f"; quarantined: {', '.join(sorted(quarantine.keys() & {m.node_id for m in plan.members}))}"
    n = spec.node_count(len(pool))
    if not n:
        return wait(f"{reason}; {_short(spec, len(pool))}", blame)
    reason = "; ".join(filter(None, [reason, idle_note(spec, pool[n:], n)]))
    nxt = make_plan(spec, pool[:n], plan.generation + 1, plan.restart_count + 1, reason, plan.master_port, ports, salt)
    return dataclasses.replace(blame, action=Action.LAUNCH, reason=reason, plan=nxt)


def _kind(fault: GenerationReport | None) -> str:
    if fault is None or fault.reason == AGENT_RESTARTED:
        return "node_lost"
    if fault.state is GenerationState.STOPPED:
        return "sigterm"
    if fault.failed_rank < 0:
        return "msrun_failure"
    return "hang" if fault.reason.startswith("no heartbeat") else "rank_failure"


def _short(spec: JobSpec, usable: int) -> str:
    return (f"waiting for nodes: {usable} usable, need min_nodes={spec.min_nodes} (up to max_nodes={spec.max_nodes}) "
            f"giving a world size in {spec.valid_world_sizes()}")


def _keep_order(plan: Plan, alive: list[NodeRecord]) -> list[NodeRecord]:
    """Usable nodes for the next generation: the plan's members in their order, then the others."""
    by_id = {n.node_id: n for n in alive}
    survivors = [by_id[m.node_id] for m in plan.members if m.node_id in by_id]
    return survivors + [n for n in alive if plan.member(n.node_id) is None]


def _planned(spec: JobSpec, plan: Plan, current: list[GenerationReport], nodes: list[NodeRecord],
             alive: list[NodeRecord], ports: PortRange, salt: int, now: float, st: JobStatus) -> Decision:
    """A healthy running generation: restart it on request, scale it down to ``max_nodes``,
    drain members marked for it, or scale up to joined nodes once none has joined for
    ``scale_up_settle_s``. All are planned relaunches: the ranks checkpoint on SIGTERM and
    the next generation resumes at that step; none counts as a restart."""
    draining = sorted(n.node_id for n in nodes if n.draining and plan.member(n.node_id) is not None)
    pool = _keep_order(plan, alive)
    n = spec.node_count(len(pool))

    def nxt(reason: str) -> Plan:
        return make_plan(spec, pool[:n], plan.generation + 1, plan.restart_count, reason, plan.master_port, ports,
                         salt, planned=True)
    if st.restart_requested >= plan.generation:
        if not n:
            return Decision(Action.NOTHING, note=f"restart waits: {_short(spec, len(pool))}")
        reason = "planned: restart requested by the operator"
        return Decision(Action.LAUNCH, reason, nxt(reason), kind="restart")
    if len(plan.members) > spec.max_nodes and n:
        reason = f"planned: scale down to max_nodes={spec.max_nodes} (world size {plan.worker_num} -> " \
                 f"{n * spec.workers_per_node})"
        return Decision(Action.LAUNCH, reason, nxt(reason), kind="scale_down")
    if draining:
        if not n:
            return Decision(Action.NOTHING, note=f"drain of {', '.join(draining)} waits: {_short(spec, len(pool))}")
        reason = "; ".join(filter(None, [f"planned: drain of {', '.join(draining)}", idle_note(spec, pool[n:], n)]))
        return Decision(Action.LAUNCH, reason, nxt(reason), kind="drain")
    joined = tuple(x.node_id for x in pool if plan.member(x.node_id) is None)
    if not joined or n * spec.workers_per_node <= plan.worker_num:
        return Decision(Action.NOTHING, note=idle_note(spec, [x for x in pool if x.node_id in joined],
                                                        len(plan.members)))
    since = st.scale_up_since if st.scale_up_nodes == joined and st.scale_up_since else now
    running = len(current) == len(plan.members) and all(r.state is GenerationState.RUNNING for r in current)
    if now - since < spec.scale_up_settle_s or not running:
        note = (f"scale-up pending: {', '.join(joined)} joined; world size {plan.worker_num} -> "
                f"{n * spec.workers_per_node} once no node joined for scale_up_settle_s={spec.scale_up_settle_s:g}"
                + ("" if running else " and every rank has started"))
        return Decision(Action.NOTHING, note=note, scale_up_nodes=joined, scale_up_since=since)
    added = [x.node_id for x in pool[:n] if plan.member(x.node_id) is None]
    reason = "; ".join(filter(None, [f"planned: scale up, {', '.join(added)} joined (world size {plan.worker_num} -> "
                                     f"{n * spec.workers_per_node})", idle_note(spec, pool[n:], n)]))
    return Decision(Action.LAUNCH, reason, nxt(reason), kind="scale_up")
