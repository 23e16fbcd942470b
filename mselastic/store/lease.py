"""Leased keys kept alive: node registration and leader election.

A :class:`KeptLease` refreshes its lease every ``ttl/3``. Two things can go wrong,
and they are told apart because the right reaction differs:

- ``lost``: etcd says the lease has expired. To everyone else this owner's keys
  are gone: the agent self-fences and registers anew, the leader steps down.
- ``unreachable``: no renewal succeeded for 60% of the TTL (cleared by the next
  success), early enough for the owner to act before etcd expires the lease. Either etcd is down (then nobody can act on the expiry and training
  should go on) or this node is partitioned (then the rest of the cluster will
  relaunch without it, and it must stop its workers). The owner decides; the
  agent asks its peers (see ``agent/node.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from mselastic.core import fencing
from mselastic.core.waits import within
from mselastic.store.etcd import PermanentError, Store, TemporaryError

log = logging.getLogger(__name__)
#: Without a renewal for this share of the TTL, the lease is reported unreachable.
UNREACHABLE_FRACTION = 0.6


probe_s = fencing.probe_s


class KeptLease:
    def __init__(self, store: Store, ttl_s: int) -> None:
        if ttl_s < 2:
            raise ValueError(f"lease TTL must be at least 2 s (got {ttl_s})")
        self.store = store
        self.ttl_s = ttl_s
        self.id = 0
        self.lost = asyncio.Event()
        self.unreachable = asyncio.Event()
        #: Until when (fencing.clock(), this process's clock) the lease surely holds in etcd: the request
        #: time of the last grant or renewal etcd answered, plus the TTL less the clocks' drift.
        self.valid_until = 0.0
        self._task: asyncio.Task[None] | None = None

    def _held_from(self, sent: float) -> None:
        self.valid_until = sent + self.ttl_s * (1 - fencing.DRIFT)

    async def grant(self) -> int:
        sent = fencing.clock()
        self._keep(await self.store.grant(self.ttl_s), sent)
        return self.id

    def _keep(self, lease_id: int, sent: float) -> None:
        """``lease_id`` held since a request sent at ``sent``: kept alive from now on."""
        self.id = lease_id
        self._held_from(sent)
        self.lost.clear()
        self._last_ok = time.monotonic()
        self._task = asyncio.create_task(self._keep_alive(), name=f"lease-{self.id:x}")

    async def adopt(self, lease_id: int) -> bool:
        """Keep alive a lease an earlier owner left (an elasticd that crashed, #45), if etcd still
        holds it with this TTL: renewed once, then kept like a granted one. False otherwise (the
        owner then grants its own)."""
        sent = fencing.clock()
        try:
            ttl = await within(self.store.refresh(lease_id), timeout=self.ttl_s / 3)
        except (TemporaryError, PermanentError, asyncio.TimeoutError) as e:
            log.info("lease %x not taken over (%s)", lease_id, e or "timeout")
            return False
        if ttl <= 0 or ttl != self.ttl_s:
            log.info("lease %x not taken over (%s)", lease_id, "expired" if ttl <= 0 else f"its TTL is {ttl}s")
            return False
        self._keep(lease_id, sent)
        return True

    async def _keep_alive(self) -> None:
        interval = self.ttl_s / 3
        while not self.lost.is_set():
            await asyncio.sleep(interval)
            sent = fencing.clock()
            try:
                ttl = await within(self.store.refresh(self.id), timeout=interval)
            except (TemporaryError, PermanentError, asyncio.TimeoutError) as e:
                silent = time.monotonic() - self._last_ok
                if silent >= UNREACHABLE_FRACTION * self.ttl_s and not self.unreachable.is_set():
                    log.warning("lease %x: no renewal for %.1fs (%s)", self.id, silent, e or "timeout")
                    self.unreachable.set()
                continue
            if ttl <= 0:
                log.warning("lease %x expired", self.id)
                self.lost.set()
            else:
                if self.unreachable.is_set():
                    log.info("lease %x renewed again", self.id)
                    self.unreachable.clear()
                self._held_from(sent)
                self._last_ok = time.monotonic()

    def abandon(self) -> None:
        """Stop refreshing, and take the lease as lost, without asking etcd: it expires there by
        itself. A node that fenced itself without etcd does so, so that a leader does not count on
        it for as long as its renewals still get through (a one-way cut) and it cannot be told."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.lost.set()

    async def release(self) -> None:
        """Stop refreshing and revoke (best effort: an unreachable etcd lets it expire)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=1)  # (a loop deaf to it is left: the revoke ends it)
            self._task = None
        if self.id and not self.lost.is_set():
            try:
                await within(self.store.revoke(self.id), timeout=2)
            except (TemporaryError, PermanentError, asyncio.TimeoutError) as e:
                log.info("lease %x not revoked (%s); it expires by itself", self.id, e)
        self.lost.set()


@dataclasses.dataclass(frozen=True)
class Term:
    """One tenure as leader. ``create_revision`` of the leader key is the fencing token."""

    create_revision: int
    lease: KeptLease

    def guard(self, store: Store) -> Any:
        """The compare every write of this leader carries (etcd's ``concurrency`` package's
        ``IsOwner``): the leader key is still the one this term created. A deposed leader's
        transaction fails it and writes nothing."""
        return store.tx.create(store.keys.leader.encode()) == self.create_revision

    async def put(self, store: Store, key: str, value: str) -> bool:
        """Write ``key`` as this leader: False, and nothing written, once it is deposed."""
        return await store.txn([self.guard(store)], [store.tx.put(key.encode(), value.encode())])

    async def delete(self, store: Store, key: str) -> bool:
        """Delete ``key`` as this leader: False, and nothing deleted, once it is deposed."""
        return await store.txn([self.guard(store)], [store.tx.delete(key.encode())])


class Election:
    """Campaign for ``store.keys.leader`` with ``value``; one winner at a time."""

    def __init__(self, store: Store, value: str, ttl_s: int) -> None:
        self.store = store
        self.value = value
        self.ttl_s = ttl_s

    async def campaign(self, stop: asyncio.Event) -> Term | None:
        """Block until this process leads (a Term) or ``stop`` is set (None)."""
        while not stop.is_set():
            term = None
            try:
                async for attempt in self.store.retry.reconnecting(stop):
                    with attempt:
                        term = await self._try_once(stop)
            except (TemporaryError, PermanentError):
                return None  # stop was set while etcd was away
            if term is not None:
                return term
        return None

    async def _try_once(self, stop: asyncio.Event) -> Term | None:
        """One attempt: win the key, or wait until it is vacant and return None."""
        lease = KeptLease(self.store, self.ttl_s)
        try:
            await lease.grant()
            if await self.store.create(self.store.keys.leader, self.value, lease=lease.id):
                kv = await self.store.get(self.store.keys.leader)
                if kv is not None and kv.lease == lease.id:
                    return Term(kv.create_revision, lease)
        except BaseException:
            await lease.release()
            raise
        await lease.release()
        await self._wait_vacant(stop)
        return None

    async def _wait_vacant(self, stop: asyncio.Event) -> None:
        key = self.store.keys.leader
        while not stop.is_set():
            if await self.store.get(key) is None:
                return
            await _sleep_or(stop, min(0.25, self.ttl_s / 8))

    async def resign(self, term: Term) -> None:
        """Give up leadership now (delete the key if still ours, revoke the lease), 2 s each at
        most: an etcd that does not answer lets the lease, and the key with it, expire."""
        key = self.store.keys.leader
        try:
            await within(self.store.txn([self.store.tx.create(key.encode()) == term.create_revision],
                                        [self.store.tx.delete(key.encode())]), timeout=2)
        except (TemporaryError, PermanentError, asyncio.TimeoutError):
            pass
        await term.lease.release()


async def _sleep_or(stop: asyncio.Event, seconds: float) -> None:
    try:
        await within(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass
