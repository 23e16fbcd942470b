"""The leader's work queue, with client-go's semantics: per key (a job) at most one worker at a
time, and a key whose work raised is handed out again only after a per-key exponential backoff
(``ItemExponentialFailureRateLimiter``), reset by its next success."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Awaitable, Callable


def requeue_delay_s(failures: int, base_s: float = 0.5, cap_s: float = 60.0) -> float:
    """Backoff before a job whose pass raised is handled again (client-go's per-item exponential
    rate limiter): ``base_s`` doubled per consecutive failure, at most ``cap_s``, with up to 10 %
    jitter so that several failing jobs do not retry in step."""
    delay = min(cap_s, base_s * 2 ** min(max(failures - 1, 0), 30))
    return delay * (1 + random.random() / 10)


class WorkQueue:
    """One task per key at a time; failed keys held back by :func:`requeue_delay_s`."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}

    def __contains__(self, key: str) -> bool:
        """A worker for ``key`` runs now."""
        return key in self._tasks

    def busy(self) -> set[str]:
        return set(self._tasks)

    def held_back(self, key: str, now: float) -> bool:
        """A worker for ``key`` runs, or its last work raised and its backoff (monotonic ``now``) is not over."""
        return key in self._tasks or self._retry_at.get(key, 0.0) > now

    def start(self, key: str, work: Awaitable[None], on_error: Callable[[str, Exception], Awaitable[None]]) -> None:
        """Run ``work`` as ``key``'s worker; what it raises goes to ``on_error`` (then see :meth:`failed`)."""
        async def run() -> None:
            try:
                await work
                self._failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                await on_error(key, e)
            finally:
                self._tasks.pop(key, None)
        self._tasks[key] = asyncio.create_task(run(), name=f"job-{key}")

    def failed(self, key: str) -> tuple[int, float]:
        """``key``'s work failed: (consecutive failures, the backoff before it is handed out again)."""
        n = self._failures[key] = self._failures.get(key, 0) + 1
        delay = requeue_delay_s(n)
        self._retry_at[key] = time.monotonic() + delay
        return n, delay

    def forget(self, key: str) -> None:
        """``key`` is gone (a deleted job): its backoff too."""
        self._failures.pop(key, None)
        self._retry_at.pop(key, None)

    async def cancel(self) -> None:
        """Cancel every worker (leadership ended) and wait for them."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
