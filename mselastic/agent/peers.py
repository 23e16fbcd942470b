"""The other nodes, as this node's fencing sees them: their Agent addresses (read from etcd every
TTL), whether they reach etcd (asked over gRPC in a fencing round), and whether etcd answers
this node right now; also the best-effort nudge a node sends its peers (``Agent.Nudge``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc

from mselastic.core import fencing
from mselastic.core.model import MalformedRecord, NodeRecord
from mselastic.core.waits import first, within
from mselastic.store.etcd import PermanentError, Store, TemporaryError
from mselastic.store.lease import probe_s
from mselastic.tls import TlsFiles
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


async def reaches_etcd(store: Store, within_s: float) -> bool:
    """Whether etcd answers this node now, within ``within_s`` (one read, no retry): what a peer
    that cannot reach etcd asks. Not the lease keeper's view, which notices an outage only after
    most of a TTL (a peer asking earlier would be told "reachable" and fence)."""
    async def read() -> bool:
        try:
            await within(store.once(lambda: store.client.get(store.keys.leader.encode())), timeout=within_s)
            return True
        except (asyncio.TimeoutError, TemporaryError, PermanentError):
            return False

    # One read per member at once: the channel spreads calls over the members, and a frozen one
    # (a stalled disk, a GC pause: it accepts connections but answers nothing) must not decide.
    reads = [asyncio.create_task(read()) for _ in range(store.endpoint.count(",") + 1)]
    try:
        for done in asyncio.as_completed(reads):
            if await done:
                return True
        return False
    finally:
        for r in reads:
            r.cancel()


class Peers:
    """The other registered nodes' Agent addresses, by node id."""

    def __init__(self, store: Store, node_id: str, ttl_s: float, tls: TlsFiles) -> None:
        self.store, self.node_id, self.ttl_s, self.tls = store, node_id, ttl_s, tls
        self.addresses: dict[str, str] = {}
        #: When each peer was last seen registered (fencing.clock()): one gone for longer than the
        #: outage grace is forgotten (a dead node must not make every etcd outage fence).
        self._seen: dict[str, float] = {}

    @property
    def probe_s(self) -> float:
        """How long asking the peers (and etcd once more) may take: fencing stays well within the TTL."""
        return probe_s(self.ttl_s)

    async def track(self, stop: asyncio.Event, on_read: Callable[[set[str]], Awaitable[None]]) -> None:
        """Keep the addresses, read from etcd every TTL (a failed read is tried again after a
        round); ``on_read`` gets the registration keys each read found."""
        while not stop.is_set():
            try:
                _, kvs = await self.store.get_prefix(self.store.keys.nodes)
            except (TemporaryError, PermanentError):
                await first(stop, timeout_s=fencing.round_s(self.ttl_s))
                continue
            now = fencing.clock()
            for kv in kvs:
                try:
                    rec = NodeRecord.from_json(kv.value)
                except MalformedRecord:
                    continue
                if rec.node_id != self.node_id:
                    self.addresses[rec.node_id] = rec.agent_address
                    self._seen[rec.node_id] = now
            # Merged, not replaced by a read: right after an etcd stall the others may not have
            # registered again yet, and a node that knows no peers cannot tell its own cut. A
            # peer unseen for the outage grace is dead or gone: forgotten.
            for node_id, seen in list(self._seen.items()):
                if now - seen > fencing.outage_grace_s(self.ttl_s):
                    del self._seen[node_id], self.addresses[node_id]
            try:
                await on_read({kv.key for kv in kvs})
            except (TemporaryError, PermanentError):
                pass
            await first(stop, timeout_s=self.ttl_s)

    async def ask(self) -> dict[str, bool | None]:
        """Every known peer and whether it reaches etcd (None: no answer), asked at once, within
        :attr:`probe_s`."""
        within_s = self.probe_s

        async def probe(node_id: str, address: str) -> tuple[str, bool | None]:
            async with self.tls.aio_channel(address) as ch:
                try:
                    res = await pb_grpc.AgentStub(ch).Status(pb.AgentStatusRequest(check_etcd_s=within_s / 2),
                                                             timeout=within_s)
                    return node_id, bool(res.etcd_reachable)
                except grpc.aio.AioRpcError:
                    return node_id, None

        return dict(await asyncio.gather(*(probe(n, a) for n, a in self.addresses.items())))

    async def nudge(self, addresses: list[str], job: str, generation: int) -> None:
        """Tell the agents at ``addresses`` that a rank of ``job``'s ``generation`` got through
        ``init()``. Best effort: a peer that does not answer within a second pays MindSpore's 3 s."""
        async def tell(address: str) -> None:
            try:
                async with self.tls.aio_channel(address) as ch:
                    await pb_grpc.AgentStub(ch).Nudge(pb.NudgeRequest(job=job, generation=generation), timeout=1.0)
            except Exception as e:  # best effort: that node's ranks pay the 3 s
                log.debug("nudge to %s not delivered: %s", address, e, extra=dict(node=self.node_id, job=job))

        await asyncio.gather(*(tell(a) for a in addresses))
