"""How a call to etcd fails (store.etcd.Store.once), without an etcd: a CancelledError that gRPC
raises because the call's channel was closed under it (the TLS client moving to another member)
is a temporary error, retried; the task's own cancellation still propagates. (Seen: elasticd ended
at start-up, an in-flight read cancelled when its client moved on from a member still starting.)
Over TLS with several members, a member that does not answer is left for the next, once per
channel (the whole path, three members with one stopped: the three-node test in test_systemd)."""

from __future__ import annotations

import asyncio
import os

import pytest

from mselastic.store import etcd
from mselastic.store.embedded import free_port
from mselastic.store.etcd import EtcdAuth, Store, TemporaryError
from mselastic.tls import make_ca


def test_a_call_whose_channel_was_closed_is_retried_and_a_cancelled_task_stays_cancelled() -> None:
    async def go() -> None:
        store = Store("127.0.0.1:1")

        async def closed_under_it() -> None:
            raise asyncio.CancelledError()  # (what grpc.aio raises for a call on a closed channel)

        with pytest.raises(TemporaryError, match="channel was closed"):
            await store.once(closed_under_it)

        started = asyncio.Event()

        async def waits() -> None:
            started.set()
            await asyncio.sleep(10)

        task = asyncio.create_task(store.once(waits))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.close()

    asyncio.run(go())


def test_over_tls_a_member_that_does_not_answer_is_left_for_the_next_once(tmp_path: os.PathLike[str],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Three members, none listening: a connect takes the member in turn (none got ready); a call
    refused there moves the client to the next member, once, however many calls on that channel
    fail (a late failure from a channel already left moves nothing)."""
    monkeypatch.setattr(etcd, "MEMBER_READY_S", 0.05)
    ca, _ = make_ca(str(tmp_path))
    ports = [free_port() for _ in range(3)]

    async def go() -> None:
        store = Store(",".join(f"127.0.0.1:{p}" for p in ports), auth=EtcdAuth(cacert=ca))
        client = store.client
        assert isinstance(client, etcd._TlsClient)
        await client.connect()
        first = client.channel
        assert client._at == 0 and first is not None
        with pytest.raises(TemporaryError):
            await store.once(lambda: client.get(b"k"))
        assert client._at == 1 and client.channel is None
        client.move_on(first)  # (another call on the channel left: nothing more)
        assert client._at == 1
        await client.connect()
        assert client.channel is not first
        with pytest.raises(TemporaryError):
            await store.once(lambda: client.get(b"k"))
        assert client._at == 2
        await store.close()

    asyncio.run(go())
