"""The fencing rule, proven for every partition: the real decision functions of the members and
of the leader (mselastic.core.fencing) run on a simulated clock through every reachability
pattern of etcd and three nodes (each ordered pair reachable or not: 4,096 patterns, symmetric and
asymmetric), and a sample of five-node ones; then partitions that come, heal and flap, nodes that
join after the others last read who is there, agents that pause (a SIGSTOP: the watchdog kills
them) and connections that are refused instead of dropped. At every step: never two generations
with live workers; a true etcd outage leaves training untouched for its documented grace; a side
that can reach etcd and a member resumes the job within the documented bound. The check can
fail: the rules of before, or a leader that waits less than fenced_within, run the job twice.
And the table of verdicts, one row per fault of the failure matrix."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from mselastic.agent.generation import shim
from mselastic.core import fencing
from mselastic.core.fencing import MemberEvidence, NodeObservation, Rule, node_verdict, replace_verdict

TTL = 3.0
DT = 0.25
E = "etcd"
#: A launch reaches live workers this long after the leader commits (warm standbys: about a second).
LAUNCH_S = 0.5
#: The documented bound on recovery (docs/DESIGN.md, "Fencing"): the job's lease runs out, the
#: leader waits for its fencing deadline, a new leader first if the old one is cut off too.
def recovery_bound_s(ttl: float) -> float:
    return 2 * ttl + fencing.fenced_within(ttl) + 2 * fencing.round_s(ttl) + LAUNCH_S + 2 * DT


RECOVERY_BOUND_S = recovery_bound_s(TTL)
HORIZON_S = RECOVERY_BOUND_S + 4 * TTL


@dataclasses.dataclass
class Node:
    name: str
    known: set[str] = dataclasses.field(default_factory=set)  # the peers it read from etcd last
    peers_read: float = 0.0
    paused: tuple[float, float] | None = None  # its elasticd stopped (SIGSTOP) from, to
    unreported: list[int] = dataclasses.field(default_factory=list)  # generations ended, not yet said in etcd
    lease_until: float = 0.0  # its own view (fencing.NodeObservation.lease_until)
    last_ack: float = 0.0
    next_round: float = 0.0
    running: int = 0  # the generation whose workers live here (0: none)
    dies_at: float = -1.0  # the workers die then (a fence decided, the kill under way)
    abandoned: bool = False  # fenced without etcd: it stops renewing its registration
    starts: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (when, generation) launches


@dataclasses.dataclass(frozen=True)
class Evidence(MemberEvidence):
    """What the leader knows, and whether the member's address refused a connection (a firewall
    REJECTs, or nothing listens there): evidence the real rule does not use, for the mutation
    that does."""

    refused: bool = False


#: How soon after a member went the rule of before trusted a refused connection.
REFUSED_WITHIN = (fencing.round_s(TTL) + fencing.probe_s(TTL) + fencing.KILL_S) * (1 + fencing.DRIFT) / (1 - fencing.DRIFT)


def old_member_rule(o: NodeObservation) -> fencing.Verdict:
    """The member rule of before: peers that answer and do not reach etcd mean an outage, for ever."""
    answered = [p for p, a in o.peers.items() if a is not None]
    act = not o.etcd_ok and (any(o.peers.values()) or bool(o.peers and not answered))
    return fencing.Verdict(act, Rule.CUT_OFF if act else Rule.OUTAGE)


def old_leader_rule(e: MemberEvidence) -> fencing.Verdict:
    """The leader rule of before: a member whose agent does not answer is lost at once."""
    return fencing.Verdict(True, Rule.FENCE_DEADLINE) if e.running is None else replace_verdict(e)


class Sim:
    """One cluster: etcd (node leases, the leader key, the plan, the reports), the nodes' agents
    and whoever leads, stepping through time after ``links`` (the ordered pairs that carry
    packets) take effect at t=0. The rules are the real ones unless others are put in (to show
    that the check can fail)."""

    def __init__(self, names: list[str], job_node: str, leader: str, links: set[tuple[str, str]],
                 member_rule=node_verdict, leader_rule=replace_verdict,  # type: ignore[no-untyped-def]
                 changes: tuple[tuple[float, set[tuple[str, str]]], ...] = (), late: str = "",
                 pauses: dict[str, tuple[float, float]] | None = None, rejects: bool = False,
                 deaf: str = "", ttls: dict[str, float] | None = None, leader_counts_own_ttl: bool = False,
                 watchdog: bool = True, shims: bool = True) -> None:
        self.names = names
        self.links = links
        #: (from when, links): the partition changes (comes, heals, flaps).
        self.changes = sorted(changes, key=lambda c: c[0])
        #: Connections to a node that do not get through are refused (a firewall's REJECT), not dropped.
        self.rejects = rejects
        #: Its reads of the registrations never go through (its renewals do): its peers are as of t=0.
        self.deaf = deaf
        self.member_rule, self.leader_rule = member_rule, leader_rule
        #: Each node's lease TTL (its own lease_ttl_s: its renewals, rounds and deadlines follow it),
        #: said in its registration; the leader counts a member's deadline on it, or (the mutation
        #: ``leader_counts_own_ttl``, the rule of before) on its own.
        self.ttl = {n: (ttls or {}).get(n, TTL) for n in names}
        self.leader_counts_own_ttl = leader_counts_own_ttl
        #: systemd's watchdog kills a paused elasticd (False: started from the command line); each
        #: generation's shim kills its workers on the deadline elasticd last wrote (False: the
        #: mutation, the fence in elasticd alone).
        self.watchdog, self.shims = watchdog, shims
        self.nodes = {n: Node(n, lease_until=self.ttl[n] * (1 - fencing.DRIFT)) for n in names}
        self.expiry = {n: self.ttl[n] for n in names}  # etcd's view of each registration (real time)
        if late:  # it registers after the others last read the registrations
            self.expiry[late] = 0.0
        for n, node in self.nodes.items():
            node.known = {p for p in names if p != n and p != late}
            node.paused = (pauses or {}).get(n)
        self.leader, self.leader_expiry = leader, self.ttl[leader]
        self.generation, self.members = 1, [job_node]
        self.nodes[job_node].running = 1
        self.reports: dict[tuple[int, str], bool] = {}  # (generation, node) -> ended
        self.gone_since: dict[str, float] = {}
        self.since = {n: (0.0 if self.expiry[n] else None) for n in names}  # registered since (real time)
        self.violations: list[str] = []
        self.committed_at = 0.0

    def awake(self, n: str, t: float) -> bool:
        p = self.nodes[n].paused if n in self.nodes else None
        return p is None or not p[0] <= t < p[1]

    def rpc(self, a: str, b: str) -> bool:
        return (a, b) in self.links and (b, a) in self.links and self.awake(a, self.t) and self.awake(b, self.t)

    def live(self) -> set[int]:
        return {n.running for n in self.nodes.values() if n.running}

    t = 0.0

    def step(self, t: float) -> None:
        self.t = t
        while self.changes and self.changes[0][0] <= t:
            self.links = self.changes.pop(0)[1]
        # A paused elasticd misses its watchdog: systemd kills it (its workers die with it) and
        # starts it again, which revokes its old registration and registers anew.
        for node in self.nodes.values():
            ttl = self.ttl[node.name]
            if self.watchdog and node.paused and t >= node.paused[0] + fencing.watchdog_s(ttl) and node.paused[1] > t:
                node.paused = (node.paused[0], t)
                if node.running:
                    node.dies_at = t
                self.expiry[node.name] = t if self.rpc(node.name, E) else self.expiry[node.name]
            # The generation's shim (agent/generation/shim.py), paused elasticd or not: past the deadline
            # elasticd last wrote (its lease view plus the grace) and its lag, a poll and the kill.
            if (self.shims and node.running and node.dies_at < 0
                    and t - node.lease_until >= fencing.outage_grace_s(ttl) + shim.lag_s(ttl)):
                node.dies_at = t + shim.POLL_S + fencing.KILL_S
        # etcd: registrations and the leader key expire.
        for n in self.names:
            node = self.nodes[n]
            if not self.awake(n, t):
                continue
            # Renewals every TTL/3: applied when they reach etcd, acknowledged when the answer comes back.
            ttl = self.ttl[n]
            acked = t - node.last_ack < 0.6 * ttl
            if self.leader == n and (n, E) in self.links and self.leader_expiry > t and acked:
                self.leader_expiry = t + ttl  # (a leader without answers steps down: it renews no more)
            if (n, E) in self.links and self.expiry[n] > t and not node.abandoned:
                self.expiry[n] = t + ttl
                if (E, n) in self.links:
                    node.lease_until, node.last_ack = t + ttl * (1 - fencing.DRIFT), t
            elif self.expiry[n] <= t and self.rpc(n, E):  # registers again (a new lease)
                self.expiry[n], self.since[n] = t + ttl, t
                node.lease_until, node.last_ack, node.abandoned = t + ttl * (1 - fencing.DRIFT), t, False
            if self.rpc(n, E) and t - node.peers_read >= ttl and n != self.deaf:  # Peers.track: every TTL
                node.known |= {p for p in self.names if p != n and self.expiry[p] > t}
                node.peers_read = t
        if self.leader_expiry <= t:  # a node that reaches etcd wins the election
            candidates = [n for n in self.names if self.rpc(n, E)]
            if candidates:
                self.leader, self.leader_expiry = candidates[0], t + self.ttl[candidates[0]]
        for node in self.nodes.values():
            self._agent(node, t)
        self._lead(t)
        live = self.live()
        if len(live) > 1:
            self.violations.append(f"t={t:.2f}: generations {sorted(live)} both have live workers")

    def _agent(self, node: Node, t: float) -> None:
        if 0 <= node.dies_at <= t:  # (killed: by the agent, or by the shim while it is paused)
            node.unreported.append(node.running)
            node.running, node.dies_at = 0, -1.0
        if not self.awake(node.name, t):
            return  # (its workers train on meanwhile, until the shim kills them)
        if node.unreported and (node.name, E) in self.links:  # its reports that generations ended get to etcd
            self.reports.update({(g, node.name): True for g in node.unreported})
            node.unreported.clear()
        for when, gen in list(node.starts):
            if when <= t:
                node.starts.remove((when, gen))
                if gen == self.generation and node.dies_at < 0 and not node.running:
                    node.running = gen
        if node.running and node.dies_at < 0 and node.running != self.generation and self.rpc(node.name, E):
            node.dies_at = t + fencing.round_s(self.ttl[node.name])  # its superseded-generation check (a safety net)
        # _deadline_loop: the outage grace past the lease is over, whatever else is seen.
        ttl = self.ttl[node.name]
        if node.running and node.dies_at < 0 and t - node.lease_until >= fencing.outage_grace_s(ttl):
            node.dies_at = t + 0.1
            node.abandoned = True
            return
        unreachable = t - node.last_ack >= 0.6 * ttl
        if not node.running or node.dies_at >= 0 or not unreachable or t < node.next_round:
            return
        node.next_round = t + fencing.round_s(ttl)
        decided = t + fencing.probe_s(ttl)
        peers: dict[str, bool | None] = {p: (self.rpc(p, E) if self.rpc(node.name, p) else None)
                                         for p in sorted(node.known)}
        obs = NodeObservation(now=decided, ttl_s=ttl, lease_until=node.lease_until, etcd_ok=self.rpc(node.name, E),
                              peers=peers)
        if self.member_rule(obs).act:
            node.dies_at = decided + 0.1  # the kill: well within fencing.KILL_S
            node.abandoned = True

    def _lead(self, t: float) -> None:
        leader = self.leader
        if self.leader_expiry <= t or not self.rpc(leader, E):
            return  # no leader, or one that cannot read etcd (or is paused): nothing is decided
        registered = {n for n in self.names if self.expiry[n] > t}
        present = {n for n in registered if self.rpc(leader, n) or n == leader}
        ended = {m for m in self.members if self.reports.get((self.generation, m))}
        held = False
        for m in self.members:
            if m in present or m in ended:
                self.gone_since.pop(m, None)
                continue
            if m not in registered:
                self.gone_since.setdefault(m, t)
            else:
                self.gone_since.pop(m, None)
            node = self.nodes[m]
            running = None
            if self.rpc(leader, m):
                # (An agent says "running" until its workers are gone, a fence under way too.)
                running = frozenset({("job", node.running)} if node.running else set())
            # Refused: a firewall rejects. (A paused elasticd's socket still accepts: no refusal.)
            refused = not self.rpc(leader, m) and self.rejects
            verdict = self.leader_rule(Evidence(
                now=t, ttl_s=self.ttl[leader if self.leader_counts_own_ttl else m], registered=m in registered, gone_since=self.gone_since.get(m), running=running,
                wanted=frozenset({("job", self.generation)}), refused=refused))
            held = held or not verdict.act
        lost = [m for m in self.members if m not in present or m in ended]
        if held or not lost:
            return
        # Relaunch on one node that reaches etcd (its agent checks the plan there) and the leader.
        for n in sorted(present, key=lambda n: (n in ended, n != self.members[0], n)):
            if self.rpc(n, E) and (self.rpc(leader, n) or n == leader):
                self.generation, self.members, self.committed_at = self.generation + 1, [n], t
                self.nodes[n].starts.append((t + LAUNCH_S, self.generation))
                self.gone_since.clear()
                return


def run(names: list[str], job_node: str, leader: str, links: set[tuple[str, str]],
        **rules) -> tuple[Sim, list[str]]:  # type: ignore[no-untyped-def]
    sim, problems = Sim(names, job_node, leader, links, **rules), []
    final = sim.changes[-1][1] if sim.changes else links
    still = not sim.changes and not any(n.paused for n in sim.nodes.values())
    reachable = {n for n in names if (n, E) in final and (E, n) in final}
    meshed = still and all(sim.rpc(a, b) for a, b in itertools.combinations(names, 2))
    job_ttl, longest = sim.ttl[job_node], max(sim.ttl.values())
    outage_until = job_ttl + fencing.outage_grace_s(job_ttl) - fencing.round_s(job_ttl) - 1.0
    bound = recovery_bound_s(longest)
    steps = int((bound + 4 * longest) / DT)
    for i in range(1, steps + 1):
        t = i * DT
        sim.step(t)
        # A true etcd outage (nobody reaches it, the nodes reach each other): training untouched.
        if not reachable and meshed and t <= outage_until and sim.nodes[job_node].running != 1:
            problems.append(f"t={t:.2f}: etcd out for every node, yet the workers stopped")
            break
    # A side that can reach etcd and a node to run on: the job runs again within the bound.
    can_recover = any(sim.rpc(l, E) and any(sim.rpc(m, E) and (m == l or sim.rpc(l, m)) for m in names)
                      for l in names)
    settled = max([c[0] for c in rules.get("changes", ())] + [p[1] for p in (rules.get("pauses") or {}).values()]
                  + [0.0])
    if not still:  # the recovery bound is for a partition that holds from the start; after the last
        # change, the job must run again within it, if it can
        if can_recover and reachable and not sim.live() and settled + bound <= steps * DT:
            problems.append(f"nothing runs at the end, though {sorted(reachable)} reach etcd")
        return sim, sim.violations + problems
    if can_recover and reachable and not sim.live():
        problems.append(f"nothing runs at the end, though {sorted(reachable)} reach etcd")
    if can_recover and sim.generation > 1 and sim.committed_at + LAUNCH_S > bound:
        problems.append(f"recovered at {sim.committed_at + LAUNCH_S:.1f}s, past the bound {bound:.1f}s")
    return sim, sim.violations + problems


def patterns(names: list[str]) -> list[tuple[str, str]]:
    ends = [E, *names]
    return [(a, b) for a in ends for b in ends if a != b]


def test_every_partition_of_three_nodes_keeps_one_generation_and_recovers() -> None:
    names = ["n0", "n1", "n2"]
    pairs = patterns(names)
    checked = steps = 0
    failures: list[str] = []
    for bits in range(2 ** len(pairs)):
        links = {p for k, p in enumerate(pairs) if bits >> k & 1}
        for leader in ("n0", "n1"):  # the job on n0; its node leads, or another does (n2 is n1's mirror)
            sim, problems = run(names, "n0", leader, links)
            checked += 1
            steps += int(HORIZON_S / DT)
            failures += [f"leader {leader}, cut {sorted(set(pairs) - links)}: {p}" for p in problems[:1]]
    print(f"fencing: {checked} runs ({2 ** len(pairs)} reachability patterns x 2 leaders) of {int(HORIZON_S / DT)} "
          f"steps each, {steps} steps checked, {len(failures)} failures")
    assert not failures, "\n".join(failures[:20])


def test_a_sample_of_five_node_partitions() -> None:
    names = [f"n{i}" for i in range(5)]
    pairs = patterns(names)
    rng = random.Random(29)
    failures: list[str] = []
    for _ in range(400):
        links = {p for p in pairs if rng.random() < rng.choice((0.3, 0.6, 0.9))}
        leader = rng.choice(names)
        _, problems = run(names, "n0", leader, links)
        failures += [f"leader {leader}, cut {sorted(set(pairs) - links)}: {p}" for p in problems[:1]]
    print(f"fencing: 400 five-node patterns, {len(failures)} failures")
    assert not failures, "\n".join(failures[:20])


def test_the_old_rules_run_the_job_twice_when_the_leaders_rack_is_cut_off() -> None:
    """The check can fail: with the rules of before put back, the rack case of issue 29 (n0 leads
    and runs the job; n0 and n2 lose etcd and n1, and still reach each other) trains on both sides,
    and the enumeration finds it among others."""
    names = ["n0", "n1", "n2"]
    cut = {(a, b) for a in ("n0", "n2") for b in (E, "n1")}
    links = set(patterns(names)) - cut - {(b, a) for a, b in cut}
    _, problems = run(names, "n0", "n0", links, member_rule=old_member_rule, leader_rule=old_leader_rule)
    assert any("both have live workers" in p for p in problems), problems
    _, problems = run(names, "n0", "n0", links)
    assert not problems, problems
    pairs = patterns(names)
    twice = sum(any("both have live workers" in p for p in run(
        names, "n0", "n0", {p for k, p in enumerate(pairs) if bits >> k & 1},
        member_rule=old_member_rule, leader_rule=old_leader_rule)[1]) for bits in range(0, 2 ** len(pairs), 7))
    print(f"fencing: the old rules run the job twice in {twice} of {len(range(0, 2 ** len(pairs), 7))} patterns")
    assert twice > 0


FULL = set(patterns(["n0", "n1", "n2"]))
NO_ETCD = {(a, b) for a, b in FULL if E not in (a, b)}


def changing(rng: random.Random) -> dict:  # type: ignore[type-arg]
    """One run with a partition that changes: it comes while training, heals, flaps, or follows a
    whole-cluster etcd outage; sometimes a node joins after the others read who is there, one
    never gets a read of the registrations through (its renewals do), and sometimes connections
    are refused instead of dropped."""
    pairs = sorted(FULL)
    cut = {p for p in pairs if rng.random() < rng.choice((0.2, 0.5, 0.8))}
    pattern = set(pairs) - cut
    t1 = rng.uniform(0.3, 14.0)
    t2 = t1 + rng.uniform(0.3, 5.0)
    kind = rng.choice(("comes", "heals", "flaps", "after an outage"))
    first, changes = {"comes": (FULL, ((t1, pattern),)), "heals": (pattern, ((t1, FULL),)),
                      "flaps": (pattern, ((t1, FULL), (t2, pattern))),
                      "after an outage": (NO_ETCD, ((t1, pattern),))}[kind]
    return dict(links=set(first), changes=changes, leader=rng.choice(("n0", "n1", "n2")),
                late=rng.choice(("", "", "n1", "n2")), rejects=rng.random() < 0.25,
                deaf=rng.choice(("", "", "", "n0", "n1")), kind=kind)


def test_partitions_that_come_heal_and_flap_keep_one_generation() -> None:
    rng = random.Random(2912)
    failures: list[str] = []
    for _ in range(3000):
        c = changing(rng)
        kind = c.pop("kind")
        _, problems = run(["n0", "n1", "n2"], "n0", c.pop("leader"), c.pop("links"), **c)
        failures += [f"{kind} at {[round(t, 2) for t, _ in c['changes']]}, late {c['late'] or '-'}, "
                     f"deaf {c['deaf'] or '-'}, rejects {c['rejects']}: {p}" for p in problems[:1]]
    print(f"fencing: 3000 changing partitions, {len(failures)} failures")
    assert not failures, "\n".join(failures[:20])


PAUSES = (0.5, 2.0, 4.0, 5.0, 7.0, 30.0)  # seconds an elasticd is stopped (longer ones meet the watchdog)


@pytest.mark.parametrize("who, watchdog, shims", [(who, watchdog, shims) for who in ("n0", "n1")
                                                   for watchdog, shims in ((True, False), (False, True), (True, True))])
def test_a_paused_elasticd_is_killed_before_it_can_be_replaced(who: str, watchdog: bool, shims: bool) -> None:
    """The job's node's elasticd (or the leader's) is SIGSTOPped: no renewals, no rounds, no
    answers, and its workers train on. It is replaced only after the watchdog killed it (and
    its workers) or, without systemd, the generation's shim killed the workers, or it wakes and
    is adopted; under every partition of a sample besides."""
    rng = random.Random(31)
    failures: list[str] = []
    runs = 0
    for pause in PAUSES:
        for start in (0.1, 1.3, 2.9):
            for _ in range(40):
                cut = {p for p in sorted(FULL) if rng.random() < 0.15}
                _, problems = run(["n0", "n1", "n2"], "n0", "n1", FULL - cut, pauses={who: (start, start + pause)},
                                  changes=((start, FULL - cut),), watchdog=watchdog, shims=shims)
                runs += 1
                failures += [f"paused {pause}s from {start}, cut {sorted(cut)}: {p}" for p in problems[:1]]
    print(f"fencing: {runs} runs with {who}'s elasticd paused ({'a' if watchdog else 'no'} watchdog, "
          f"{'' if shims else 'no '}shims), {len(failures)} failures")
    assert not failures, "\n".join(failures[:20])


def test_a_leader_that_waits_less_than_fenced_within_runs_the_job_twice() -> None:
    """The check can fail on timing: n0 runs the job and knows only n1 (n2 joins after n0 last
    read who is there); n0 and n1 lose etcd and still reach each other, so n0 trains on through
    what looks like an outage; n2 reaches etcd alone and leads. A leader that waits half of
    fenced_within runs the job twice; the real one does not."""
    cut = {(a, b) for a in ("n0", "n1") for b in (E, "n2")}
    links = FULL - cut - {(b, a) for a, b in cut}

    def hasty(e: MemberEvidence) -> fencing.Verdict:
        if e.gone_since is not None:
            e = dataclasses.replace(e, gone_since=e.gone_since - fencing.fenced_within(TTL) / 2)
        return replace_verdict(e)

    _, problems = run(["n0", "n1", "n2"], "n0", "n1", links, late="n2", leader_rule=hasty)
    assert any("both have live workers" in p for p in problems), problems
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", links, late="n2")
    assert not problems, problems


def test_a_job_node_with_a_longer_lease_ttl_than_the_leaders_keeps_one_generation_under_every_partition() -> None:
    """The job's node n0 at lease_ttl_s = 10, the others at 3 (a config rollout half done): n0
    fences on its own TTL, and the leader counts n0's deadline on the TTL n0 said in its
    registration. Every reachability pattern, with n1 leading (at 3)."""
    names = ["n0", "n1", "n2"]
    pairs = patterns(names)
    failures: list[str] = []
    for bits in range(2 ** len(pairs)):
        links = {p for k, p in enumerate(pairs) if bits >> k & 1}
        _, problems = run(names, "n0", "n1", links, ttls={"n0": 10.0})
        failures += [f"cut {sorted(set(pairs) - links)}: {p}" for p in problems[:1]]
    print(f"fencing: {2 ** len(pairs)} patterns with the job's node at TTL 10 and the leader at 3, "
          f"{len(failures)} failures")
    assert not failures, "\n".join(failures[:20])


def test_a_leader_that_counts_a_members_deadline_on_its_own_shorter_ttl_runs_the_job_twice() -> None:
    """The check can fail on the TTL (#45): n0 runs the job at lease_ttl_s = 10 and knows only n1
    (n2 joins after n0 last read who is there); n0 and n1 (both at 10) lose etcd and still reach
    each other, so n0 trains on through what looks like an outage, up to 3 x 10 s past its lease;
    n2 (at 3) reaches etcd alone and leads. A leader that counts n0's deadline on its own 3 s runs
    the job twice; one that counts it on the 10 s n0 said does not."""
    cut = {(a, b) for a in ("n0", "n1") for b in (E, "n2")}
    links = FULL - cut - {(b, a) for a, b in cut}
    ttls = {"n0": 10.0, "n1": 10.0}
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", links, late="n2", ttls=ttls, leader_counts_own_ttl=True)
    assert any("both have live workers" in p for p in problems), problems
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", links, late="n2", ttls=ttls)
    assert not problems, problems


def test_a_watchdog_slower_than_fenced_within_runs_the_job_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail on the watchdog: with it at twice fenced_within (and no shims, which
    would kill the workers anyway), a paused elasticd's workers outlive the leader's wait."""
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", set(FULL), pauses={"n0": (1.0, 60.0)}, shims=False)
    assert not problems, problems
    monkeypatch.setattr(fencing, "watchdog_s", lambda ttl: 2 * fencing.fenced_within(ttl))
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", set(FULL), pauses={"n0": (1.0, 60.0)}, shims=False)
    assert any("both have live workers" in p for p in problems), problems
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", set(FULL), pauses={"n0": (1.0, 60.0)})
    assert not problems, problems  # (the shim)


def test_a_paused_elasticd_without_a_watchdog_or_a_shim_runs_the_job_twice() -> None:
    """The check can fail on the shim (#45): elasticd started from the command line, paused for
    40 s; without the generation's shim its workers train on beside their replacement."""
    pause = {"n0": (1.0, 41.0)}
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", set(FULL), pauses=pause, watchdog=False)
    assert not problems, problems
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", set(FULL), pauses=pause, watchdog=False, shims=False)
    assert any("both have live workers" in p for p in problems), problems


def test_a_leader_that_trusts_a_refused_connection_runs_the_job_twice() -> None:
    """The check can fail on evidence: n2 reaches etcd only from 10 s, after n0 last read who is
    registered. At 12 s n0 and n1 lose etcd and n2 (whose firewall REJECTs them) and still reach
    each other: to n0, which does not know n2, it looks like an outage. n2 leads once n1's key
    expires and finds n0's address refusing. A leader that takes the refusal for "no elasticd
    there" (the rule of before) replaces n0 while it trains on; the real one waits for n0's
    deadline."""
    cut = {(a, b) for a in ("n0", "n1") for b in (E, "n2")}
    partition = FULL - cut - {(b, a) for a, b in cut}

    def trusting(e: MemberEvidence) -> fencing.Verdict:
        if isinstance(e, Evidence) and e.refused and e.gone_since is not None and not e.registered \
                and e.running is None and e.now - e.gone_since >= REFUSED_WITHIN:
            return fencing.Verdict(True, Rule.FENCE_DEADLINE, "refused")
        return replace_verdict(e)

    scenario = dict(late="n2", rejects=True, changes=((10.0, set(FULL)), (12.0, partition)))
    start = FULL - {("n2", E), (E, "n2")}
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", start, leader_rule=trusting, **scenario)
    assert any("both have live workers" in p for p in problems), problems
    _, problems = run(["n0", "n1", "n2"], "n0", "n1", start, **scenario)
    assert not problems, problems


# -- the verdict tables: one row per fault of the failure matrix --------------------------------

NOW = 100.0


def member(etcd_ok: bool = False, lease_left: float = -1.0, **peers: bool | None) -> fencing.Verdict:
    return node_verdict(NodeObservation(now=NOW, ttl_s=TTL, lease_until=NOW + lease_left, etcd_ok=etcd_ok,
                                        peers=dict(peers)))


@pytest.mark.parametrize("fault, verdict, act, rule", [
    ("etcd member failing over: a read goes through", lambda: member(True, n1=False), False, Rule.ETCD_ANSWERS),
    ("this node cut from etcd, a peer reaches it", lambda: member(lease_left=2, n1=True, n2=False), True, Rule.CUT_OFF),
    ("partitioned from everything", lambda: member(lease_left=2, n1=None, n2=None), True, Rule.ISOLATED),
    ("etcd away for a moment, lease holds", lambda: member(lease_left=1, n1=False, n2=None), False, Rule.LEASE_HOLDS),
    ("the leader's rack cut: a silent peer may lead", lambda: member(n1=None, n2=False), True, Rule.PEER_SILENT),
    ("etcd down for everyone (a stall, an outage)", lambda: member(n1=False, n2=False), False, Rule.OUTAGE),
    ("etcd down for everyone, for too long",
     lambda: member(lease_left=-fencing.outage_grace_s(TTL), n1=False), True, Rule.OUTAGE_TOO_LONG),
    ("a one-node cluster without etcd", lambda: member(), False, Rule.OUTAGE),
    ("woken after a pause longer than the grace: etcd answers, the deadline decides",
     lambda: member(True, lease_left=-fencing.outage_grace_s(TTL) - 1), True, Rule.OUTAGE_TOO_LONG),
])
def test_member_verdicts(fault: str, verdict, act: bool, rule: Rule) -> None:  # type: ignore[no-untyped-def]
    v = verdict()
    assert (v.act, v.rule) == (act, rule), (fault, v)


GEN = frozenset({("lenet", 4)})


def leader(registered: bool = False, gone_for: float | None = 0.0,
           running: frozenset | None = None) -> fencing.Verdict:  # type: ignore[type-arg]
    return replace_verdict(MemberEvidence(now=NOW, ttl_s=TTL, registered=registered,
                                          gone_since=None if gone_for is None else NOW - gone_for,
                                          running=running, wanted=GEN))


@pytest.mark.parametrize("fault, verdict, act, rule", [
    ("a member that fenced itself", lambda: leader(running=frozenset()), True, Rule.SAYS_STOPPED),
    ("a member's lease expired in an etcd stall", lambda: leader(running=GEN), False, Rule.SAYS_RUNNING),
    ("the leader cannot reach a member that renews (a firewall's REJECT, a dropped link)",
     lambda: leader(registered=True, gone_for=None), False, Rule.RENEWS),
    ("a member partitioned or dead, or its elasticd killed (a refused connection proves nothing), just gone",
     lambda: leader(gone_for=3.0), False, Rule.BEFORE_DEADLINE),
    ("... past its fencing deadline", lambda: leader(gone_for=fencing.fenced_within(TTL)), True,
     Rule.FENCE_DEADLINE),
])
def test_leader_verdicts(fault: str, verdict, act: bool, rule: Rule) -> None:  # type: ignore[no-untyped-def]
    v = verdict()
    assert (v.act, v.rule) == (act, rule), (fault, v)
    if rule is Rule.BEFORE_DEADLINE:
        assert NOW < v.until <= NOW + fencing.fenced_within(TTL)


def test_the_leader_waits_at_least_as_long_as_a_member_may_train_without_etcd() -> None:
    """The proof's arithmetic: a member stops by its lease + the grace + a round + a probe + the
    kill (its clock); the leader, which sees the lease gone no earlier than it ends, waits longer
    on a clock that may run DRIFT faster."""
    for ttl in (2.0, 3.0, 5.0, 10.0, 30.0):
        member_s = (fencing.outage_grace_s(ttl) + fencing.round_s(ttl) + fencing.probe_s(ttl) + fencing.KILL_S)
        assert fencing.fenced_within(ttl) * (1 - fencing.DRIFT) >= member_s * (1 + fencing.DRIFT)
