"""This node's generation reports in etcd: written when a generation changes (at once for a
change of state, at most every ``interval_s`` for progress), a failed write tried again, and on a
planned shutdown the final ones flushed before the registration goes."""

from __future__ import annotations

import asyncio
import logging

from mselastic.agent.generation.supervisor import Generation
from mselastic.core.waits import within
from mselastic.store.etcd import PermanentError, Store, TemporaryError

log = logging.getLogger(__name__)


class Reports:
    def __init__(self, store: Store, node_id: str, interval_s: float) -> None:
        self.store, self.node_id, self.interval_s = store, node_id, interval_s
        self._dirty: dict[tuple[str, int], Generation] = {}  # to write, the replaced generations' too
        self._written: dict[tuple[str, int], str] = {}  # the last report written of each generation
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._ctx = dict(node=node_id)

    def changed(self, gen: Generation, urgent: bool = True) -> None:
        """``gen`` changed: its report is written soon (``urgent``: at once)."""
        self._dirty[(gen.plan.job, gen.plan.generation)] = gen
        self._wake.set()
        if urgent:
            self._urgent.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Write changed reports until ``stop``; etcd errors are retried on the next round,
        training goes on. Progress (a beat every step) is written at most once per
        ``interval_s``; state changes (first step, failure, success) at once."""
        while not stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            self._urgent.clear()
            await self._write()
            try:
                await within(self._urgent.wait(), timeout=self.interval_s)
            except asyncio.TimeoutError:
                pass

    async def _write(self) -> None:
        """Write the reports changed since the last time (a failed write is kept for the next)."""
        last = self._written
        for key in sorted(self._dirty):
            gen = self._dirty.pop(key, None)
            if gen is None:  # (written meanwhile by the final flush)
                continue
            body = gen.report().to_json()
            if last.get(key) == body:
                continue
            try:
                await self.store.put(self.store.keys.report(key[0], key[1], self.node_id), body)
                last = self._written = {k: v for k, v in last.items() if k[0] != key[0] or k[1] >= key[1] - 1}
                last[key] = body
            except Exception as e:  # an error of a kind not foreseen must not end the reports either
                if isinstance(e, (TemporaryError, PermanentError)):
                    log.warning("report not written (%s); will retry", e, extra=self._ctx)
                else:
                    log.exception("report not written; will retry", extra=self._ctx)
                self._dirty.setdefault(key, gen)
                self._wake.set()

    async def flush(self, within_s: float) -> None:
        """On a planned shutdown, once the workers are gone: their final reports (stopped, and at
        which step) reach etcd before the registration goes, so that the restart is not taken for a
        crash. Bounded: etcd may be away (the successor then closes them as a crash's)."""
        async def write_all() -> None:  # (a generation may change again while a round writes)
            while self._dirty:
                await self._write()
                if self._dirty:
                    await asyncio.sleep(0.1)

        try:
            await within(write_all(), within_s)
        except asyncio.TimeoutError:
            log.warning("final reports not written within %.0fs: the restart counts as a crash", within_s,
                        extra=self._ctx)
        unwritten = sorted(k for k, gen in self._dirty.items() if self._written.get(k) != gen.report().to_json())
        if unwritten:
            log.warning("final reports of %s not written: the restart counts as a crash",
                        ", ".join(f"{job} g{g}" for job, g in unwritten), extra=self._ctx)
