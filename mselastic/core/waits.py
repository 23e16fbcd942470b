"""Waiting on asyncio events, shared by the agent and the coordinator."""

from __future__ import annotations

import asyncio


async def first(*events: asyncio.Event, timeout_s: float | None = None) -> None:
    """Wait until one of ``events`` is set (or ``timeout_s``)."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
