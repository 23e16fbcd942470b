"""The leader's channels to agents: a channel nobody watches or calls any more is closed; pings
thin out in large clusters."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mselastic.daemon import liveness
from mselastic.daemon.agents import Agents


def test_an_agents_channel_is_closed_once_unwatched_and_its_last_call_is_over() -> None:
    async def run() -> None:
        server = grpc.aio.server()  # (an agent that answers nothing: the channel connects all the same)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        agents = Agents(1.0)
        try:
            first = agents.channel(address)
            assert await _ready(first)
            agents.prune({address}, idle_s=0.0)  # watched: kept
            agents.stub(address, 0.3)  # a call that may last 0.3 s
            agents.prune(set(), idle_s=0.0)
            await asyncio.sleep(0)
            assert first.get_state() is grpc.ChannelConnectivity.READY  # its call may still run
            await asyncio.sleep(0.4)
            agents.prune(set(), idle_s=0.0)
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.UsageError, match="Channel is closed"):  # (open: UNIMPLEMENTED)
                await first.unary_unary("/x.Y/Z")(b"", timeout=1)
            second = agents.channel(address)  # the next call dials again
            assert second is not first and await _ready(second)
        finally:
            await agents.close()
            await server.stop(None)

    asyncio.run(run())


async def _ready(channel: grpc.aio.Channel) -> bool:
    try:
        await asyncio.wait_for(channel.channel_ready(), 5)
        return True
    except asyncio.TimeoutError:
        return False


def test_the_leader_pings_each_agent_less_often_past_500_nodes() -> None:
    """At most ``PINGS_PER_S`` pings a second in all: every 0.5 s up to 500 nodes, then fewer."""
    assert [liveness.keepalive_ms(n) for n in (1, 4, 500, 1000, 4000)] == [500, 500, 500, 1000, 4000]
    assert liveness.client_options(4000)["grpc.keepalive_time_ms"] == 4000
    assert liveness.client_options(3)["grpc.keepalive_timeout_ms"] == liveness.KEEPALIVE_TIMEOUT_MS
    quiet = liveness.client_options(4000, pings=False)  # peer_evidence = false: no pings, same connections
    assert quiet == {"grpc.client_idle_timeout_ms": 2 ** 31 - 1, "grpc.min_reconnect_backoff_ms": 2000}
