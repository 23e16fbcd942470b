"""The leader's fan-out to the node agents: one gRPC channel per agent, and the pushes it makes
through them (Launch, Stop, and the Status questions that choose a planned stop's step)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from mselastic import metrics
from mselastic.core import contract
from mselastic.core.model import Plan
from mselastic.daemon import liveness
from mselastic.store.etcd import CHANNEL_OPTIONS
from mselastic.tls import TlsFiles
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc
from mselastic.wire import plan_to_pb

log = logging.getLogger(__name__)

#: A planned stop's step is ahead of the highest step the members' agents report by the steps the
#: ranks make in twice the time the question took plus this: the plan's commit in etcd, and the
#: Launch's or Stop's way to every agent (its lock, its checks of the plan in etcd).
STOP_MARGIN_S = 1.0


#: Refusals a push will meet again until someone changes a configuration or a record.
_LASTING = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)

#: What to do when another node's agent refuses this leader's push, without TLS and with it.
_DENIED_HINT = ("; the nodes reach each other without node certificates: give them TLS (elasticctl certs issue "
                "... --role node; tls_cert, tls_key, tls_cacert), or set insecure_listen = true on a network you trust")
_DENIED_HINT_TLS = ("; this node's certificate must have the node role (O=node), its node id as CN, and be signed "
                    "by the CA the other node trusts (elasticctl certs issue DIR NODE_ID --role node)")


#: A leader's channel to an agent that is not watched (see :meth:`Presence.suspected`) is
#: closed once its last call ended (or ran out of time) this long ago.
IDLE_CHANNEL_S = 60.0


class Agents:
    """gRPC channels to the node agents, one per address. This node's own agent is reached
    through its local socket (``local``: its address -> ``unix:PATH``), where the node role is
    granted without a certificate."""

    def __init__(self, timeout_s: float, tls: TlsFiles = TlsFiles(), local: dict[str, str] | None = None,
                 keepalive: bool = True) -> None:
        self.timeout_s = timeout_s
        self.keepalive = keepalive  # (peer evidence: see mselastic.daemon.liveness)
        self.tls = tls
        self.local = local or {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._used: dict[str, float] = {}  # address -> when its channel's latest call ends at most (monotonic)
        self._closing: set[asyncio.Task[None]] = set()
        self._stamps: dict[str, object] = {}  # address -> the TLS files' stamp its channel was dialled with
        #: The registered nodes, as the leader last saw them: a new channel's keepalive interval
        #: is sized for them (``liveness.client_options``).
        self.cluster_size = 0

    def channel(self, address: str) -> grpc.aio.Channel:
        stamp = self.tls.stamp()
        if address in self._channels and self._stamps.get(address) != stamp:
            # A certificate renewed in place: this call dials anew with it; the old channel's calls
            # in flight end (or run out of time) before it closes.
            grace = max(0.0, self._used.get(address, 0.0) - time.monotonic())
            self._close(self._channels.pop(address), address, grace)
        if address not in self._channels:
            self._stamps[address] = stamp
            options = {**CHANNEL_OPTIONS, **liveness.client_options(max(self.cluster_size, len(self._channels) + 1),
                                                                    pings=self.keepalive)}
            self._channels[address] = self.tls.aio_channel(self.local.get(address, address),
                                                           options=list(options.items()))
        self._used[address] = max(self._used.get(address, 0.0), time.monotonic())
        return self._channels[address]

    def prune(self, keep: set[str], idle_s: float = IDLE_CHANNEL_S) -> None:
        """Close the channels to agents not in ``keep`` that no call used for ``idle_s``: a node
        that left every plan would otherwise be pinged (``liveness.KEEPALIVE_MS``) for as long as
        this elasticd leads, and, once gone, redialled every couple of seconds for ever."""
        now = time.monotonic()
        for address in [a for a, used in self._used.items() if a not in keep and now - used > idle_s]:
            del self._used[address]
            self._close(self._channels.pop(address), address)

    def _close(self, channel: grpc.aio.Channel, address: str, grace: float | None = None) -> None:
        task = asyncio.create_task(channel.close(grace), name=f"close-{address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def stub(self, address: str, timeout_s: float) -> pb_grpc.AgentStub:
        """A stub for one call that gives up after ``timeout_s`` (its channel is kept that long)."""
        channel = self.channel(address)
        self._used[address] = max(self._used[address], time.monotonic() + timeout_s)
        return pb_grpc.AgentStub(channel)

    async def launch(self, plan: Plan, only: set[str] | None = None, extra_timeout_s: float = 0.0) -> dict[str, str]:
        """Push ``plan`` to its members (or to the ``only`` ones); failures are logged, not raised.
        ``extra_timeout_s``: the agents first stop what runs there, with that grace period.
        Returns, by node id, a lasting refusal (see ``_LASTING``) with what to do about it, or
        ``""`` for any other answer (accepted, refused for now, unreachable): only an unbroken
        run of lasting refusals fails a job."""
        msg = pb.LaunchRequest(plan=plan_to_pb(plan))

        async def one(address: str, node_id: str) -> tuple[str, str]:
            try:
                res = await self.stub(address, self.timeout_s + extra_timeout_s).Launch(
                    msg, timeout=self.timeout_s + extra_timeout_s)
                if not res.accepted:
                    log.warning("launch refused by %s: %s", node_id, res.message,
                                extra=dict(job=plan.job, generation=plan.generation, node=node_id))
                return node_id, ""
            except grpc.aio.AioRpcError as e:
                metrics.GRPC_ERRORS.labels("Launch").inc()
                if e.code() not in _LASTING:
                    log.warning("launch push to %s failed: %s", node_id, e.details(),
                                extra=dict(job=plan.job, generation=plan.generation, node=node_id))
                    return node_id, ""
                hint = "" if e.code() == grpc.StatusCode.FAILED_PRECONDITION else \
                    _DENIED_HINT_TLS if self.tls.cert else _DENIED_HINT
                why = f"{e.code().name}: {e.details()}{hint}"
                log.error("launch push to %s failed: %s", node_id, why,
                          extra=dict(job=plan.job, generation=plan.generation, node=node_id))
                return node_id, why

        return dict(await asyncio.gather(*(one(m.agent_address, m.node_id) for m in plan.members
                                           if only is None or m.node_id in only)))

    async def stop_step(self, job: str, generation: int, addresses: dict[str, str]) -> int:
        """The step every rank of ``generation`` stops at in a planned stop, chosen ahead of them
        all: the highest step the members' agents report, one more (a rank may be inside it), one
        for a rank a step ahead, and the steps made until every agent has it (see STOP_MARGIN_S).
        0 when a member's ranks have not said where they resumed, or none answers: each agent then
        chooses for ranks that are all its own, and across nodes the ranks agree at their backstop."""
        t0 = time.monotonic()

        async def one(address: str) -> pb.AgentStatusResponse | None:
            try:
                return await self.stub(address, min(self.timeout_s, 2.0)).Status(
                    pb.AgentStatusRequest(), timeout=min(self.timeout_s, 2.0))
            except grpc.aio.AioRpcError:
                metrics.GRPC_ERRORS.labels("Status").inc()
                return None

        answers = await asyncio.gather(*(one(a) for a in addresses.values()))
        took = time.monotonic() - t0
        steps, rate = [], 0.0
        for res in answers:
            for g in res.generations if res is not None else ():
                if g.job == job and g.generation == generation:
                    steps += [r.step for r in g.ranks]
                    rate = max(rate, g.steps_per_s)
        return contract.stop_step_ahead(steps, rate, 2 * took + STOP_MARGIN_S)

    async def stop(self, job: str, generation: int, grace_s: float, addresses: dict[str, str],
                   stop_at: int | None = None, final: bool = False) -> dict[str, list[int]]:
        """Stop ``generation`` on these members; with ``grace_s`` > 0 the ranks first checkpoint at
        ``stop_at`` (by default :meth:`stop_step` of these members). ``final``: the job ends here, no
        relaunch follows (its standbys and snapshot folder go too)."""
        if grace_s > 0 and stop_at is None:
            stop_at = await self.stop_step(job, generation, addresses)
        msg = pb.StopRequest(job=job, generation=generation, grace_period_s=grace_s, stop_at_step=stop_at or 0,
                             final=final)

        async def one(node_id: str, address: str) -> tuple[str, list[int]]:
            try:
                res = await self.stub(address, grace_s + self.timeout_s).Stop(msg, timeout=grace_s + self.timeout_s)
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
        self._used.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
