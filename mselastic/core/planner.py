"""The planner: membership + job spec + history -> what the coordinator does next.

A pure function (no etcd, no clock, no processes), so every rule is a row in a
table test. The coordinator reads the state from etcd, calls :func:`decide`,
and applies the one decision it returns: a :data:`Decision`, one small class per
action, whole when made (a launch's plan with its members' devices).

Rules, in order:
1. A job in a terminal state: nothing.
2. No plan yet: launch generation 1 on the oldest eligible nodes, as many as
   give the largest valid world size (see :mod:`mselastic.core.batching`) within
   ``min_nodes``..``max_nodes``; otherwise wait. Nodes left out are named in the reason.
3. A member reported FAILED (or STOPPED: its ranks exited on a SIGTERM the
   coordinator did not send), or a member's registration is gone (lease expired):
   relaunch as generation g+1 on the surviving members in their old order, new
   nodes appended, cut to a valid size; if restarts are exhausted, fail the job.
   A generation that could not start because of the spec (``LAUNCH_SPEC``: the
   script or checkpoint_dir unusable) fails the job at once: a relaunch cannot help.
4. Every member reported SUCCEEDED: the job succeeded.
5. Waiting for ``min_nodes`` for longer than ``min_nodes_timeout_s``: fail the job.
3a. Before that: a member whose elasticd was stopped on request (its report: AGENT_SHUTDOWN)
   is no fault: a planned relaunch once enough members are registered (see
   :func:`elasticd_restart`), counted neither as a restart nor against the node.
6. A healthy generation asked to restart (``elasticctl restart``), with more members
   than ``max_nodes`` (``elasticctl scale``), with a member being drained, or with
   joined nodes that give a larger valid world size and no further join for
   ``scale_up_settle_s``: a *planned* relaunch (the ranks checkpoint on SIGTERM; not
   counted as a restart).
7. Otherwise, a member whose agent has refused the current plan's pushes for
   ``denied_push_fail_s`` (a setting it lacks), without reporting on it: fail the job, naming it.

Quarantine (Horovod's blacklist with cooldown): each fault is blamed on a node
(the one whose rank failed first, or a lost one); a node blamed
``quarantine_after_failures`` times is left out of new generations for
``quarantine_cooldown_s``, doubled with every further failure (at most an hour).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import zlib
from typing import Callable, ClassVar, Iterable, Mapping

from mselastic.core import devices
from mselastic.core.kinds import RelaunchReason
from mselastic.core.model import GenerationReport, JobStatus, Member, NodeRecord, Plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import FailureCause, GenerationState, JobState

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
class Blame:
    """What a decision that follows a fault says of it: the report that showed it, or the members
    lost; the node failure counts and quarantine after it (None: unchanged), and the generation
    whose failure those counts include."""

    fault: GenerationReport | None = None
    lost_nodes: tuple[str, ...] = ()
    node_failures: Mapping[str, int] | None = None
    quarantined_until: Mapping[str, float] | None = None
    failures_counted_through: int = 0


class _Blamed:
    """The blame's parts, read off a decision that carries one."""

    blame: Blame

    @property
    def fault(self) -> GenerationReport | None:
        return self.blame.fault

    @property
    def lost_nodes(self) -> tuple[str, ...]:
        return self.blame.lost_nodes

    @property
    def node_failures(self) -> Mapping[str, int] | None:
        return self.blame.node_failures

    @property
    def quarantined_until(self) -> Mapping[str, float] | None:
        return self.blame.quarantined_until

    @property
    def failures_counted_through(self) -> int:
        return self.blame.failures_counted_through


@dataclasses.dataclass(frozen=True)
class Launch(_Blamed):
    """Commit ``plan`` as the next generation (after a fault: ``blame``), for ``kind``."""

    action: ClassVar[Action] = Action.LAUNCH
    reason: str
    plan: Plan
    kind: RelaunchReason = RelaunchReason.INITIAL
    blame: Blame = Blame()


@dataclasses.dataclass(frozen=True)
class Fail(_Blamed):
    """The job fails; ``kind``: the relaunch it would have been (None: none)."""

    action: ClassVar[Action] = Action.FAIL
    reason: str
    kind: RelaunchReason | None = None
    blame: Blame = Blame()


@dataclasses.dataclass(frozen=True)
class Wait(_Blamed):
    """Not enough nodes: the job stays PENDING or RESTARTING (after a fault: ``blame``)."""

    action: ClassVar[Action] = Action.WAIT
    reason: str
    blame: Blame = Blame()


@dataclasses.dataclass(frozen=True)
class Succeed:
    """Every member finished: the job succeeded."""

    action: ClassVar[Action] = Action.SUCCEED
    reason: str


@dataclasses.dataclass(frozen=True)
class Nothing:
    """Nothing to do; ``note``: what the job waits for or leaves out (a pending scale-up since
    ``scale_up_since``), for its status; ``reason``: why not, where it is worth a log line."""

    action: ClassVar[Action] = Action.NOTHING
    reason: str = ""
    note: str = ""
    scale_up_nodes: tuple[str, ...] = ()
    scale_up_since: float = 0.0


#: The planner's decision for one job: one small class per action (as torch's rendezvous actions
#: or kubelet's pod actions), each with what that action needs and nothing else.
Decision = Launch | Fail | Wait | Succeed | Nothing


def blame_of(d: Decision) -> Blame:
    """The blame a decision carries (none: an empty one)."""
    return d.blame if isinstance(d, (Launch, Fail, Wait)) else Blame()


def master_port(job: str, generation: int, previous: int | None, ports: PortRange, salt: int = 0) -> int:
    """A per-generation port: spread by a hash, never the previous generation's.

    ``salt`` (the coordinator passes the etcd revision it decided at, mixed with its namespace)
    keeps two clusters on one host from choosing the same port for a job of the same name.
    """
    port = ports.start + zlib.crc32(f"{job}/{generation}/{salt}".encode()) % ports.span
    if port == previous:
        port = ports.start + (port - ports.start + 1) % ports.span
    return port


def eligible(nodes: Iterable[NodeRecord], spec: JobSpec, free_slots: Mapping[str, int] | None = None) -> list[NodeRecord]:
    """Nodes a new generation may use, oldest registration first. ``free_slots``: the slots of
    each node that no other job holds (None: all of them)."""
    def free(n: NodeRecord) -> int:
        return n.slots if free_slots is None else min(n.slots, free_slots.get(n.node_id, n.slots))
    ok = [n for n in nodes if free(n) >= spec.workers_per_node and not n.cordoned]
    return sorted(ok, key=lambda n: (n.create_revision, n.node_id))


def make_plan(
    spec: JobSpec, nodes: list[NodeRecord], generation: int, restart_count: int, reason: str,
    previous_port: int | None, ports: PortRange, salt: int = 0, planned: bool = False,
    kind: RelaunchReason = RelaunchReason.INITIAL,
) -> Plan:
    members = tuple(
        Member(node_id=n.node_id, node_rank=i, local_workers=spec.workers_per_node,
               agent_address=n.agent_address, host=n.host, lease_ttl_s=n.lease_ttl_s)
        for i, n in enumerate(nodes)
    )
    return Plan(
        job=spec.name, generation=generation, members=members,
        world_size=spec.workers_per_node * len(members), master_addr=members[0].host,
        master_port=master_port(spec.name, generation, previous_port, ports, salt),
        restart_count=restart_count, reason=reason, planned=planned, kind=kind,
    )


def idle_note(spec: JobSpec, idle: list[NodeRecord], used: int) -> str:
    """Why nodes that could run the job are left out of a generation of ``used`` nodes."""
    if not idle:
        return ""
    why = (f"max_nodes={spec.max_nodes}" if used >= spec.max_nodes else
           f"global_batch_size={spec.global_batch_size} needs a world size in {spec.valid_world_sizes()}")
    return f"node(s) {', '.join(n.node_id for n in idle)} idle: {why}"


@dataclasses.dataclass
class Situation:
    """What a decision step looks at: the job, its plan and reports, the nodes, the clock."""

    spec: JobSpec
    plan: Plan | None
    st: JobStatus
    nodes: list[NodeRecord]
    #: Eligible nodes (free slots, not cordoned), out of quarantine, oldest first.
    alive: list[NodeRecord]
    quarantine: dict[str, float]
    #: The current generation's reports.
    current: list[GenerationReport]
    ports: PortRange
    salt: int
    now: float
    busy: str
    #: False while another job waits for slots: no scale-up into free ones (first come, first served).
    may_grow: bool = True
    #: Members of the current plan whose agent refuses its pushes for good (a setting it lacks):
    #: node id -> (for how long, why); after ``refused_fail_s`` the job fails.
    refused: Mapping[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    refused_fail_s: float = float("inf")

    def wait(self, reason: str, blame: Blame = Blame(), kind: RelaunchReason | None = None) -> Decision:
        """WAIT, or FAIL (as ``kind``) once the wait has lasted too long; ``blame`` carries the fault history."""
        reason = "; ".join(filter(None, [reason, self.busy]))
        if self.st.waiting_since and self.now - self.st.waiting_since > self.spec.min_nodes_timeout_s:
            reason = f"{reason} for more than min_nodes_timeout_s={self.spec.min_nodes_timeout_s:g}"
            return Fail(reason, kind, blame)
        return Wait(reason, blame)

    @functools.cached_property
    def failed(self) -> list[GenerationReport]:
        """Members whose generation failed, or stopped on a SIGTERM nobody here sent (it is still
        the plan), first detected first. (This compares the agents' clocks, it subtracts none: a
        skew larger than the gap between two detections, milliseconds apart under NTP, can only
        change which of two failing nodes is named first. The order the reports reach etcd is no
        better: an agent tears the generation down before it writes its report.)"""
        return sorted((r for r in self.current if r.state in (GenerationState.FAILED, GenerationState.STOPPED)),
                      key=lambda r: (r.detected_at or float("inf"), r.node_id))

    @functools.cached_property
    def lost(self) -> tuple[str, ...]:
        """Members whose registration is gone (their lease expired)."""
        assert self.plan is not None
        registered = {n.node_id for n in self.nodes if n.slots >= self.spec.workers_per_node}
        return tuple(m.node_id for m in self.plan.members if m.node_id not in registered)

    @functools.cached_property
    def pool(self) -> list[NodeRecord]:
        """Usable nodes for the next generation: the members in their order, then the others."""
        assert self.plan is not None
        return _keep_order(self.plan, self.alive)

    def planned(self, reason: str, kind: RelaunchReason) -> Plan:
        """The next generation of a healthy one, on the pool (a planned relaunch)."""
        assert self.plan is not None
        n = self.spec.node_count(len(self.pool))
        return make_plan(self.spec, self.pool[:n], self.plan.generation + 1, self.plan.restart_count, reason,
                         self.plan.master_port, self.ports, self.salt, planned=True, kind=kind)


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
    free_slots: Mapping[str, int] | None = None,
    busy: str = "",
    may_grow: bool = True,
    devices: Mapping[str, NodeRecord] | None = None,
    devices_held: Mapping[str, Mapping[int, str]] | None = None,
    refused: Mapping[str, tuple[float, str]] | None = None,
    refused_fail_s: float = float("inf"),
) -> Decision:
    """The next step for one job. ``reports`` are the current generation's, by node id;
    ``salt`` varies the master port (see :func:`master_port`); ``now`` times the waits
    against ``status`` (the job's status as stored: waiting since, node failure counts
    and quarantine, the pending scale-up). ``free_slots``: per node, the slots no other
    job holds; ``busy`` says who holds the others, added to the reason of a wait.
    ``may_grow`` False (another job is queued for slots): no scale-up. ``devices`` (the usable
    nodes, by id) and ``devices_held`` (per node, the device ids other jobs hold): a launch's plan
    comes with each member's devices assigned (:func:`mselastic.core.devices.assign`), or, a node
    short of free devices, no launch this time; without them, no devices are assigned.
    ``refused``: members of the current plan whose agent refuses its pushes for good, for how
    long and why; one refusing for ``refused_fail_s`` fails the job.

    The rules are the steps of :data:`STEPS`, in order: the first that applies decides."""
    if state.terminal:
        return Nothing()
    st = status or JobStatus(state)
    nodes = list(nodes)
    quarantine = {n: t for n, t in st.quarantined_until.items() if t > now}
    alive = [n for n in eligible(nodes, spec, free_slots) if n.node_id not in quarantine]
    current = [r for r in reports.values() if plan is not None and r.generation == plan.generation]
    s = Situation(spec, plan, st, nodes, alive, quarantine, current, ports, salt, now, busy, may_grow,
                  refused or {}, refused_fail_s)
    for step in STEPS:
        d = step(s)
        if d is not None:
            return _with_devices(d, plan, devices, devices_held)
    return Nothing()


#: The reason of a launch put off for want of free devices (the coordinator logs it).
NO_DEVICES = "no launch this pass"


def _with_devices(d: Decision, previous: Plan | None, nodes: Mapping[str, NodeRecord] | None,
                  held: Mapping[str, Mapping[int, str]] | None) -> Decision:
    """A launch's plan with its members' devices (the decision made whole where it is made)."""
    if not isinstance(d, Launch) or nodes is None or held is None:
        return d
    try:
        return dataclasses.replace(d, plan=devices.assign(d.plan, nodes, held, previous))
    except devices.NoDevices as e:  # (should not be: the free slots counted the devices)
        return Nothing(reason=f"{NO_DEVICES}: {e}")


def first_launch(s: Situation) -> Decision | None:
    """No plan yet: generation 1 (or the one after a deleted job's last) on the oldest eligible
    nodes, as many as give the largest valid world size; otherwise wait."""
    if s.plan is not None:
        return None
    n = s.spec.node_count(len(s.alive))
    if not n:
        return s.wait(_short(s.spec, len(s.alive)))
    reason = "; ".join(filter(None, ["initial launch", idle_note(s.spec, s.alive[n:], n)]))
    first = make_plan(s.spec, s.alive[:n], s.st.generation + 1, 0, reason, None, s.ports, s.salt)
    return Launch(reason, first, RelaunchReason.INITIAL)


def refused_for_good(s: Situation) -> Decision | None:
    """A member's agent has refused the current plan's pushes for ``refused_fail_s`` (a setting it
    lacks: a job uid outside its range, devices it does not have) and has not reported on it: the
    same on every push, so the job fails, saying what to fix; no node is blamed."""
    assert s.plan is not None
    said = {r.node_id for r in s.current}
    for node_id, (for_s, why) in sorted(s.refused.items()):
        if node_id not in said and s.plan.member(node_id) is not None and for_s >= s.refused_fail_s:
            return Fail(f"node {node_id} refused generation {s.plan.generation} for {for_s:.0f} s ({why}); "
                        f"resubmit once its configuration is fixed")
    return None


def launch_error(s: Situation) -> Decision | None:
    """A generation that could not start because of the spec (its script or checkpoint_dir) on
    every member: the same on every relaunch, so fail the job now and blame no node. Where
    another member started, the error is that node's (a missing mount): the next step blames
    it like any fault. Until every member has said, wait."""
    assert s.plan is not None
    bad = next((r for r in s.failed if r.cause is FailureCause.LAUNCH_SPEC), None)
    if bad is None:
        return None
    said = {r.node_id: r for r in s.current}
    if any(r.cause is not FailureCause.LAUNCH_SPEC for r in said.values()):
        return None
    if len(said) < len(s.plan.members):
        return Nothing(note=f"node {bad.node_id} could not start generation {s.plan.generation}: "
                            f"{bad.reason}; waiting for the other members")
    return Fail(f"generation {s.plan.generation} could not start on node {bad.node_id}: {bad.reason}",
                RelaunchReason.LAUNCH_ERROR, Blame(fault=bad))


def cannot_go_on(s: Situation) -> Decision | None:
    """A rank said it cannot go on (no checkpoint every rank can load, the checkpoint directory
    full): a relaunch would meet the same, so the job fails with its reason, and no node is blamed."""
    assert s.plan is not None
    bad = next((r for r in s.failed if r.cause is FailureCause.TRAINER_FATAL), None)
    if bad is None:
        return None
    return Fail(f"generation {s.plan.generation}: rank {bad.failed_rank} on node {bad.node_id} {bad.reason}",
                RelaunchReason.RANK_FAILURE, Blame(fault=bad))


def mixed_resume(s: Situation) -> Decision | None:
    """Ranks of one generation resumed from different steps (their views of checkpoint_dir differ,
    or a script loads on its own): their parameters differ and data parallel would average them, so
    the job fails, loudly, instead of training a silently wrong model."""
    steps: dict[int, list[str]] = {}
    for r in s.current:
        for rank, step in r.resumed_steps.items():
            steps.setdefault(step, []).append(rank)
    if len(steps) < 2:
        return None
    assert s.plan is not None
    said = "; ".join(f"rank(s) {', '.join(sorted(ranks, key=int))} from step {step}"
                     for step, ranks in sorted(steps.items()))
    return Fail(f"generation {s.plan.generation}: the ranks resumed from different checkpoints ({said}); check that "
                f"checkpoint_dir is the same shared directory on every node", RelaunchReason.RANK_FAILURE)


def elasticd_restart(s: Situation) -> Decision | None:
    """A member's elasticd was stopped on request (SIGTERM, ``systemctl restart``): it stopped its
    ranks at a step first and its report says so (AGENT_SHUTDOWN), then its registration went.
    Not a fault: a planned relaunch on the members registered now (that node's own once it is
    back), counted neither against ``max_restarts`` nor against the node. The other members' ranks,
    which stopped at the same step (their SIGTERM), go along. Anything else failed or lost: a fault."""
    if s.plan is None or not s.failed:
        return None
    shut = {r.node_id for r in s.failed if r.state is GenerationState.STOPPED
            and r.cause is FailureCause.AGENT_SHUTDOWN}
    along = all(r.state is GenerationState.STOPPED and r.cause in (FailureCause.AGENT_SHUTDOWN, FailureCause.SIGTERM)
                for r in s.failed)
    if not shut or not along or set(s.lost) - shut:
        return None
    reason = f"planned: elasticd stopped on request on {', '.join(sorted(shut))}"
    if not s.spec.node_count(len(s.pool)):
        return s.wait(f"{reason}; {_short(s.spec, len(s.pool))}")
    return Launch(reason, s.planned(reason, RelaunchReason.ELASTICD_RESTART), RelaunchReason.ELASTICD_RESTART)


def relaunch_after_fault(s: Situation) -> Decision | None:
    """A member failed or is lost: blame a node (quarantine it after repeated blame), then
    relaunch as g+1 on the survivors in their order with joined nodes appended, cut to a valid
    size; wait if too few are left; fail once restarts are exhausted."""
    plan, spec = s.plan, s.spec
    assert plan is not None
    if not s.failed and not s.lost:
        return None
    fault = s.failed[0] if s.failed else None
    if fault is not None:
        if fault.state is GenerationState.STOPPED or fault.cause is FailureCause.AGENT_RESTARTED:
            reason = f"on node {fault.node_id}, {fault.reason}"
        else:
            rank = f"rank {fault.failed_rank}" if fault.failed_rank >= 0 else "msrun"
            reason = f"{rank} on node {fault.node_id} failed: {fault.reason}"
    else:
        reason = f"node(s) lost: {', '.join(s.lost)}"
    failures, quarantine = dict(s.st.node_failures), dict(s.quarantine)
    if s.st.failures_counted_through < plan.generation:  # a waiting job sees the same fault on every pass
        for blamed in ([] if fault is not None and fault.cause is FailureCause.DEVICE  # (its device set aside)
                       else [fault.node_id] if fault is not None else list(s.lost)):
            failures[blamed] = failures.get(blamed, 0) + 1
            over = failures[blamed] - spec.quarantine_after_failures
            if over >= 0:
                quarantine[blamed] = s.now + min(MAX_QUARANTINE_S, spec.quarantine_cooldown_s * 2 ** over)
    blame = Blame(fault, s.lost, failures, quarantine, plan.generation)
    if plan.restart_count >= spec.max_restarts:
        return Fail(f"restarts exhausted (max_restarts={spec.max_restarts}); last: {reason}", _kind(fault), blame)
    pool = _keep_order(plan, [n for n in s.alive if n.node_id not in quarantine])
    benched = sorted(quarantine.keys() & {m.node_id for m in plan.members})
    if benched:
        reason += f"; quarantined: {', '.join(benched)}"
    n = spec.node_count(len(pool))
    if not n:
        return s.wait(f"{reason}; {_short(spec, len(pool))}", blame, _kind(fault))
    reason = "; ".join(filter(None, [reason, idle_note(spec, pool[n:], n)]))
    nxt = make_plan(spec, pool[:n], plan.generation + 1, plan.restart_count + 1, reason, plan.master_port, s.ports,
                    s.salt, kind=_kind(fault))
    return Launch(reason, nxt, _kind(fault), blame)


def success(s: Situation) -> Decision | None:
    """Every member finished its ranks: the job succeeded."""
    assert s.plan is not None
    done = {r.node_id for r in s.current if r.state is GenerationState.SUCCEEDED}
    if done >= {m.node_id for m in s.plan.members}:
        return Succeed(f"generation {s.plan.generation} finished on every node")
    return None


def restart(s: Situation) -> Decision | None:
    """``elasticctl restart`` of this generation: a planned relaunch (ranks checkpoint first)."""
    assert s.plan is not None
    if s.st.restart_requested < s.plan.generation:
        return None
    if not s.spec.node_count(len(s.pool)):
        return Nothing(note=f"restart waits: {_short(s.spec, len(s.pool))}")
    reason = "planned: restart requested by the operator"
    return Launch(reason, s.planned(reason, RelaunchReason.RESTART), RelaunchReason.RESTART)


def scale_down(s: Situation) -> Decision | None:
    """More members than ``max_nodes`` (``elasticctl scale``): a planned relaunch on fewer."""
    assert s.plan is not None
    n = s.spec.node_count(len(s.pool))
    if len(s.plan.members) <= s.spec.max_nodes or not n:
        return None
    reason = f"planned: scale down to max_nodes={s.spec.max_nodes} (world size {s.plan.world_size} -> " \
             f"{n * s.spec.workers_per_node})"
    return Launch(reason, s.planned(reason, RelaunchReason.SCALE_DOWN), RelaunchReason.SCALE_DOWN)


def drain(s: Situation) -> Decision | None:
    """Members marked for draining: a planned relaunch without them, or wait for room."""
    assert s.plan is not None
    plan = s.plan
    draining = sorted(n.node_id for n in s.nodes if n.draining and plan.member(n.node_id) is not None)
    if not draining:
        return None
    n = s.spec.node_count(len(s.pool))
    if not n:
        return Nothing(note=f"drain of {', '.join(draining)} waits: {_short(s.spec, len(s.pool))}")
    reason = "; ".join(filter(None, [f"planned: drain of {', '.join(draining)}", idle_note(s.spec, s.pool[n:], n)]))
    return Launch(reason, s.planned(reason, RelaunchReason.DRAIN), RelaunchReason.DRAIN)


def scale_up(s: Situation) -> Decision:
    """Joined nodes that give a larger valid world size: a planned relaunch once none joined for
    ``scale_up_settle_s`` and every rank has started; until then, say so in the note."""
    plan, spec, pool = s.plan, s.spec, s.pool
    assert plan is not None
    n = spec.node_count(len(pool))
    joined = tuple(x.node_id for x in pool if plan.member(x.node_id) is None)
    if joined and n * spec.workers_per_node > plan.world_size and not s.may_grow:
        return Nothing(note=f"scale-up to {', '.join(joined)} waits: {s.busy or 'a job is queued'}")
    if not joined or n * spec.workers_per_node <= plan.world_size:
        return Nothing(note=idle_note(spec, [x for x in pool if x.node_id in joined], len(plan.members)))
    since = s.st.scale_up_since if s.st.scale_up_nodes == joined and s.st.scale_up_since else s.now
    running = len(s.current) == len(plan.members) and all(r.state is GenerationState.RUNNING for r in s.current)
    if s.now - since < spec.scale_up_settle_s or not running:
        note = (f"scale-up pending: {', '.join(joined)} joined; world size {plan.world_size} -> "
                f"{n * spec.workers_per_node} once no node joined for scale_up_settle_s={spec.scale_up_settle_s:g}"
                + ("" if running else " and every rank has started"))
        return Nothing(note=note, scale_up_nodes=joined, scale_up_since=since)
    added = [x.node_id for x in pool[:n] if plan.member(x.node_id) is None]
    reason = "; ".join(filter(None, [f"planned: scale up, {', '.join(added)} joined (world size {plan.world_size} -> "
                                     f"{n * spec.workers_per_node})", idle_note(spec, pool[n:], n)]))
    return Launch(reason, s.planned(reason, RelaunchReason.SCALE_UP), RelaunchReason.SCALE_UP)


#: The planner's rules, in order (see the module docstring): the first step that returns a decision wins.
STEPS: tuple[Callable[[Situation], Decision | None], ...] = (
    first_launch, launch_error, cannot_go_on, mixed_resume, elasticd_restart, relaunch_after_fault, success, restart,
    scale_down, drain, refused_for_good, scale_up)


def _kind(fault: GenerationReport | None) -> RelaunchReason:
    if fault is None or fault.cause is FailureCause.AGENT_RESTARTED:
        return RelaunchReason.NODE_LOST
    if fault.state is GenerationState.STOPPED:
        return RelaunchReason.SIGTERM
    if fault.cause in (FailureCause.LAUNCH_NODE, FailureCause.LAUNCH_SPEC):
        return RelaunchReason.LAUNCH_ERROR
    if fault.failed_rank < 0:
        return RelaunchReason.MSRUN_FAILURE
    if fault.cause in (FailureCause.RANK_HUNG, FailureCause.RANK_NEVER_STARTED):
        return RelaunchReason.HANG
    return RelaunchReason.RANK_FAILURE


def _short(spec: JobSpec, usable: int) -> str:
    return (f"waiting for nodes: {usable} usable, need min_nodes={spec.min_nodes} (up to max_nodes={spec.max_nodes}) "
            f"giving a world size in {spec.valid_world_sizes()}")


def _keep_order(plan: Plan, alive: list[NodeRecord]) -> list[NodeRecord]:
    """Usable nodes for the next generation: the plan's members in their order, then the others."""
    by_id = {n.node_id: n for n in alive}
    survivors = [by_id[m.node_id] for m in plan.members if m.node_id in by_id]
    return survivors + [n for n in alive if plan.member(n.node_id) is None]
