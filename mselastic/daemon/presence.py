"""Presence: which members of the live plans this leader can count on, and which jobs it must
leave alone until an absent member is known to have stopped (the leader's half of
:mod:`mselastic.core.fencing`), from the registrations, the agents' connections (peer evidence,
:mod:`mselastic.daemon.liveness`) and what their agents answer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable

import grpc

from mselastic.core import fencing
from mselastic.core.model import Member
from mselastic.daemon import liveness
from mselastic.daemon.agents import Agents
from mselastic.store.lease import probe_s
from mselastic.store.views import ClusterView
from mselastic.v1 import elastic_pb2 as pb

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Absence:
    """A plan member this leader cannot count on (unregistered, or its connection dropped), and
    what its agent says."""

    #: When this leader first saw it so (its own clock: fencing.clock()).
    since: float
    member: Member
    #: When this leader first saw it unregistered (None: registered, as far as it saw).
    gone_since: float | None = None
    #: (job, generation) the agent runs (starting or running), as of its last answer; None: not
    #: asked yet, or no answer lately.
    running: frozenset[tuple[str, int]] | None = None
    #: The verdict of the last pass (logged when its rule changes).
    verdict: fencing.Verdict | None = None
    task: "asyncio.Task[None] | None" = None


class Presence:
    """The leader's view of the members it cannot count on, for one term at a time."""

    def __init__(self, node_id: str, ttl_s: float, agents: Agents, wake: Callable[[], None],
                 peer_evidence: bool = True) -> None:
        self.node_id = node_id
        self.ttl_s = ttl_s
        self.agents = agents
        self.peer_evidence = peer_evidence
        self._wake = wake
        #: Members of live plans seen unregistered, by node id (see :meth:`excused`).
        self._absent: dict[str, Absence] = {}
        #: The lease TTL each node said: in its registration as last seen, or the longest in the live
        #: plans it is a member of (see :meth:`member_ttl_s`).
        self._said_ttl: dict[str, int] = {}
        #: Members of live plans whose agent's connection dropped: unregistered until it answers.
        self.liveness = liveness.Liveness(agents.channel, wake)
        self._blind = False  # (logged once) the evidence is ignored: most connections dropped at once

    def member_ttl_s(self, node_id: str) -> float:
        """The lease TTL a member's fencing deadline is counted on: its node's own (a node fences on
        its own TTL, which may be longer than this leader's: a config rollout half done, a site's
        choice), as it said it (a leader that never saw it registered has it from the plans); this
        leader's own only where it said none (a node of an earlier release)."""
        said = self._said_ttl.get(node_id, 0)
        return float(said) if said > 0 else self.ttl_s

    def verdict(self, node_id: str) -> fencing.Verdict | None:
        """The latest verdict on an absent member (None: not absent)."""
        a = self._absent.get(node_id)
        return a.verdict if a is not None else None

    async def end_term(self) -> None:
        """Forget everything (the term is over)."""
        tasks = [a.task for a in self._absent.values() if a.task]
        self._absent.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.liveness.close()

    def suspected(self, cluster: ClusterView) -> ClusterView:
        """Watch the connections to the agents of live plans' members (and of the suspects, until
        they answer or their registration goes), and pass the cluster on with the suspects taken
        out of its registered nodes: to the planner and to :meth:`excused` they look unregistered
        (peer evidence, ahead of the lease; see :mod:`mselastic.daemon.liveness`)."""
        registered = {n.node_id: n.agent_address for n in cluster.nodes}
        watch: dict[str, str] = {}
        for view in cluster.jobs.values():
            if view.plan is not None and not view.status.state.terminal:
                for m in view.plan.members:
                    if registered.get(m.node_id) == m.agent_address:
                        watch[m.node_id] = m.agent_address
        watch.update((n, registered[n]) for n in self.liveness.suspects if n in registered)
        self.agents.cluster_size = len(registered)
        self.liveness.watch(watch if self.peer_evidence else {})
        self.agents.prune(set(watch.values()) if self.peer_evidence else set())
        if not self.liveness.suspects:
            self._blind = False
            return cluster
        remote = len(set(watch) - {self.node_id})
        if len(self.liveness.suspects) >= 2 and 2 * len(self.liveness.suspects) > remote:
            if not self._blind:  # most of them at once: this leader's network, more likely than theirs
                log.warning("the connections to %d of %d nodes dropped at once: ignored, their leases decide",
                            len(self.liveness.suspects), remote, extra=dict(node=self.node_id))
            self._blind = True
            return cluster
        self._blind = False
        return dataclasses.replace(cluster, nodes=[n for n in cluster.nodes if n.node_id not in self.liveness.suspects])

    def excused(self, cluster: ClusterView, registered: set[str]) -> set[str]:
        """Jobs to leave alone in this pass: a member of their plan may still be training, and
        nothing may be committed without it until it is known to have stopped
        (:func:`mselastic.core.fencing.replace_verdict`).

        A member found unregistered (its lease expired: a dead node, a partition, or an etcd stall
        that expires every lease at once with every node healthy) or whose connection dropped (a
        suspect, see :meth:`suspected`: it comes here as if unregistered; ``registered`` is what
        etcd says) is asked (``Agent.Status``) what it runs. It is replaced at once when its agent
        says it runs none of the generation (it fenced itself, or an elasticd started again found
        nothing of it to adopt: agent.generation.adopt). While its agent says it runs the generation (or is
        adopting it),
        its jobs wait for it to register again (it is adopted then) or to fence itself. One that
        does not answer is replaced only once its registration has been gone for
        :func:`~mselastic.core.fencing.fenced_within` on this leader's clock; while it still
        renews its lease, never."""
        present = {n.node_id for n in cluster.nodes}
        self._said_ttl.update((n.node_id, n.lease_ttl_s) for n in cluster.nodes if n.lease_ttl_s > 0)
        wanted: dict[str, list[tuple[str, int]]] = {}
        members: dict[str, Member] = {}
        for view in cluster.jobs.values():
            if view.plan is None or view.status.state.terminal:
                continue
            reports = view.current_reports()
            for m in view.plan.members:
                # (A member that reported the generation ended, in etcd, has stopped it.)
                if m.node_id not in present and not (m.node_id in reports and reports[m.node_id].state.terminal):
                    wanted.setdefault(m.node_id, []).append((view.name, view.plan.generation))
                    members.setdefault(m.node_id, m)
                    self._said_ttl[m.node_id] = max(self._said_ttl.get(m.node_id, 0), m.lease_ttl_s)
        for node_id in list(self._absent):
            if node_id not in wanted:
                gone = self._absent.pop(node_id)
                if gone.task is not None:
                    gone.task.cancel()
                if gone.verdict is not None and not gone.verdict.act and node_id in present:
                    log.warning("node %s registered or answering again after %.1fs with its generation(s) intact: "
                                "adopted", node_id, fencing.clock() - gone.since, extra=dict(node=node_id))
        now = fencing.clock()
        held: set[str] = set()
        for node_id, gens in wanted.items():
            a = self._absent.get(node_id)
            if a is None:
                a = self._absent[node_id] = Absence(now, members[node_id])
                a.task = asyncio.create_task(self._ask(a), name=f"absent-{node_id}")
            if node_id in registered:
                a.gone_since = None
            elif a.gone_since is None:
                a.gone_since = now
            verdict = fencing.replace_verdict(fencing.MemberEvidence(
                now=now, ttl_s=self.member_ttl_s(node_id), registered=node_id in registered,
                gone_since=a.gone_since, running=a.running, wanted=frozenset(gens)))
            if a.verdict is None or verdict.rule is not a.verdict.rule:
                what = ", ".join(f"{j} generation {g}" for j, g in gens)
                if verdict.act:
                    log.warning("node %s lost (%s): %s", node_id, what, verdict.reason, extra=dict(node=node_id))
                else:
                    log.warning("node %s does not answer or is unregistered; holding %s: %s", node_id, what,
                                verdict.reason, extra=dict(node=node_id))
            a.verdict = verdict
            if not verdict.act:
                held.update(job for job, _ in gens)
        return held


    async def _ask(self, a: Absence) -> None:
        """Ask an absent member's agent what it runs, every TTL/3 (after a failed call, at once
        again), until it is forgotten. Two failed calls in a row: no answer lately."""
        failed = 0
        while True:
            probe = probe_s(self.ttl_s)
            try:
                # (Waiting for a connection up to the deadline: a channel that is reconnecting would
                # fail the call at once, and two of those 0.1 s apart would lose a healthy node.)
                res = await self.agents.stub(a.member.agent_address, probe).Status(
                    pb.AgentStatusRequest(), timeout=probe, wait_for_ready=True)
                running = frozenset((g.job, g.generation) for g in res.generations
                                    if g.state in (pb.GENERATION_STATE_STARTING, pb.GENERATION_STATE_RUNNING))
                # Another elasticd at that address (a node id moved) runs nothing of this member's.
                a.running, failed = (running if res.node_id == a.member.node_id else frozenset()), 0
                if res.node_id == a.member.node_id:
                    self.liveness.clear(res.node_id)
            except grpc.aio.AioRpcError:
                failed += 1
                if failed >= 2:
                    a.running = None
            self._wake()
            await asyncio.sleep(self.ttl_s / 3 if not failed else 0.1)
