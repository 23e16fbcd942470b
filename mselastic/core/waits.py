"""Waiting on asyncio events, shared by the agent and the coordinator."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw``, raising ``TimeoutError`` after ``timeout`` seconds (None: none): what
    ``asyncio.wait_for`` does, without its flaw in Python 3.11 (cpython gh-86296): a task cancelled
    while the thing it waits for completes gets the result and never the cancellation, so a loop
    told to stop runs on, and whoever awaits its end waits for ever (an elasticd's shutdown waited
    75 s on its lease's keep-alive loop so, its generation fenced meanwhile: ci24).
    ``asyncio.timeout`` counts cancellations (``Task.uncancel``) and loses none."""
    async with asyncio.timeout(timeout):
        return await aw


async def first(*events: asyncio.Event, timeout_s: float | None = None) -> None:
    """Wait until one of ``events`` is set (or ``timeout_s``)."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
