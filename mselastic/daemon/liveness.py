"""Peer evidence of a dead node, before its lease runs out.

The leader holds a gRPC channel to the agent of every member of a live plan, with HTTP/2
keepalive pings every ``KEEPALIVE_MS`` (answered by gRPC's own threads, not the agent's event
loop; less often in clusters of more than 500 nodes, see ``PINGS_PER_S``). A node whose elasticd
died closes that connection at once (its kernel resets it); one that lost power or its network
stops answering the pings and the channel drops after ``KEEPALIVE_TIMEOUT_MS``. Either way the
channel leaves READY, and the member becomes a *suspect*: the coordinator treats it as
unregistered, which asks its agent what it runs
(``Presence.excused``, the question waiting up to its deadline for a connection) and
calls it lost when that goes unanswered, or clears it at the first answer. So a dead node
turns into a new plan in about a second, and the lease stays the backstop (a node whose
connection looks healthy but which stopped renewing is still lost at its lease's expiry). When
most of the watched nodes drop at once, the fault is more likely the leader's own network than
theirs: the evidence is ignored and the leases decide.

Nothing here is a verdict on its own: a dropped connection only makes the leader ask, and a
node the leader cannot reach but which still renews its lease is left out of plans only while
the leader cannot reach it (it could not launch anything there either); its agent, which checks
every lease TTL whether a newer plan replaced what it runs, stops its generation itself
(``NodeAgent._fence_loop``): the leader's Stop cannot get through.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

log = logging.getLogger(__name__)

#: A leader's channel to an agent pings it this often ...
KEEPALIVE_MS = 500
#: ... and drops the connection when a ping is not answered within this.
KEEPALIVE_TIMEOUT_MS = 500

#: Options of the leader's channels to agents (added to the etcd channels' reconnect back-off).
CLIENT_OPTIONS: dict[str, object] = {
    "grpc.keepalive_time_ms": KEEPALIVE_MS,
    "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.max_pings_without_data": 0,  # default 2: the pings would stop between calls
    "grpc.client_idle_timeout_ms": 2 ** 31 - 1,  # an idle channel would leave READY every 30 min
    # gRPC takes this as the least time a connection attempt gets (the etcd channels' 200 ms would
    # fail a TLS handshake on a busy node), and reconnects at most a second apart.
    "grpc.min_reconnect_backoff_ms": 2000,
}

#: The leader's pings to all agents together, per second, at most: a channel pings every
#: ``KEEPALIVE_MS`` up to this many * that / 1000 nodes (500), less often past that (every 4 s at
#: 4000). ``make bench-liveness``: 4000 nodes pinged every 0.5 s (8000 TLS pings a second) took 73 %
#: of a core of the leader. A node whose elasticd died still drops its connection at once (its
#: kernel resets it); only a silent one (power, network) waits for a ping to go unanswered.
PINGS_PER_S = 1000


def keepalive_ms(nodes: int) -> int:
    """How often a leader that watches about ``nodes`` agents pings each."""
    return max(KEEPALIVE_MS, nodes * 1000 // PINGS_PER_S)


def client_options(nodes: int, pings: bool = True) -> dict[str, object]:
    """``CLIENT_OPTIONS`` for a channel of a leader that watches about ``nodes`` agents; without
    the pings (``peer_evidence = false``) only the connection settings."""
    if not pings:
        return {k: v for k, v in CLIENT_OPTIONS.items() if "keepalive" not in k and "ping" not in k}
    return {**CLIENT_OPTIONS, "grpc.keepalive_time_ms": keepalive_ms(nodes)}


#: Options of every elasticd's gRPC server, so that it accepts those pings (by default it
#: answers a client pinging more than once per 5 min without calls with GOAWAY).
SERVER_OPTIONS: list[tuple[str, object]] = [
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
]


class Liveness:
    """Watches the leader's channels to the agents it is told about (:meth:`watch`); a node
    whose channel left READY (to reconnecting, or failing; or never got there: TRANSIENT_FAILURE)
    is in :attr:`suspects` until its channel is READY again or :meth:`clear` is called (its agent
    answered)."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel], on_change: Callable[[], None]) -> None:
        self._channel = channel
        self._on_change = on_change
        self.suspects: set[str] = set()
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}  # node id -> (address, watcher)

    def watch(self, nodes: dict[str, str]) -> None:
        """Watch exactly these nodes (node id -> agent address); a node no longer named stops
        being watched and suspected."""
        for node_id in list(self._tasks):
            address, task = self._tasks[node_id]
            if nodes.get(node_id) != address:
                task.cancel()
                del self._tasks[node_id]
                self.suspects.discard(node_id)
        for node_id, address in nodes.items():
            if node_id not in self._tasks:
                self._tasks[node_id] = (address, asyncio.create_task(self._watch(node_id, address),
                                                                     name=f"liveness-{node_id}"))

    def clear(self, node_id: str) -> None:
        """``node_id``'s agent answered: not a suspect (until its channel drops again)."""
        if node_id in self.suspects:
            self.suspects.discard(node_id)
            log.info("node %s answers again", node_id, extra=dict(node=node_id))
            self._on_change()

    async def _watch(self, node_id: str, address: str) -> None:
        channel = self._channel(address)
        state = channel.get_state(try_to_connect=True)
        ready = False
        while state is not grpc.ChannelConnectivity.SHUTDOWN:
            if state is grpc.ChannelConnectivity.READY:
                ready = True
                self.clear(node_id)
            elif (ready or state is grpc.ChannelConnectivity.TRANSIENT_FAILURE) and node_id not in self.suspects:
                ready = False
                self.suspects.add(node_id)
                log.warning("node %s: the connection to its agent dropped (%s); asking it", node_id,
                            state.name.lower(), extra=dict(node=node_id))
                self._on_change()
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self.suspects.clear()
