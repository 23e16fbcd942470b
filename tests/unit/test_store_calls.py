"""How a call to etcd fails (store.etcd.Store.once), without an etcd: a CancelledError that gRPC
raises because the call's channel was closed under it (the TLS client moving to another member)
is a temporary error, retried; the task's own cancellation still propagates. (Seen: elasticd ended
at start-up, an in-flight read cancelled when its client moved on from a member still starting.)"""

from __future__ import annotations

import asyncio

import pytest

from mselastic.store.etcd import Store, TemporaryError


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
