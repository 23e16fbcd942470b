"""A device set aside (issue #32): when a failed rank's log names its device, this node's agent
writes ``cordons/<node>/devices/<id>`` (see :class:`mselastic.core.model.DeviceCordon`) before the
failure is reported, so that the relaunch the leader plans leaves that device out and the node
keeps serving with the others. The log is the job's own words: one job may set aside at most
:data:`MAX_BY_ONE_JOB` devices of a node within a cooldown (past that, its failures stay its
ranks'), so that a job cannot take a node's devices from the others by writing such lines. A
device that the node's tools stop showing while elasticd runs (:meth:`DeviceHealth.watch`) is set
aside until an operator puts it back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from mselastic.agent import devices as inventory
from mselastic.core.devices import format_ids
from mselastic.core.model import DeviceCordon
from mselastic.store.etcd import Store, TemporaryError

log = logging.getLogger(__name__)

#: Devices of a node one job may set aside within a cooldown.
MAX_BY_ONE_JOB = 2


class DeviceHealth:
    """Sets this node's devices aside on a failed rank's evidence (see the module's notes)."""

    def __init__(self, store: Store, node_id: str, cooldown_s: float) -> None:
        self.store, self.node_id, self.cooldown_s = store, node_id, cooldown_s
        #: Per job, the devices it set aside here, and until when they count.
        self._by_job: dict[str, dict[int, float]] = {}

    async def set_aside(self, job: str, device: int, line: str) -> bool:
        """Set ``device`` aside for ``job``'s failed rank whose log says ``line``; False when the job
        has set aside too many here already, or etcd cannot be written (the failure stays the rank's)."""
        now = time.time()
        mine = {d: t for d, t in self._by_job.get(job, {}).items() if t > now}
        if device not in mine and len(mine) >= MAX_BY_ONE_JOB:
            log.warning("job %s's ranks named %d devices of this node already (%s): device %d is not set aside; "
                        "the failure counts as its rank's", job, len(mine), sorted(mine), device,
                        extra=dict(job=job, node=self.node_id))
            return False
        until = now + self.cooldown_s if self.cooldown_s else 0.0
        record = DeviceCordon(self.node_id, device, f"job {job}: {line}"[:400], now, until)
        try:
            await self.store.put(self.store.keys.device_cordon(self.node_id, device), record.to_json())
        except TemporaryError as e:
            log.error("device %d not set aside (etcd unavailable: %s)", device, e, extra=dict(node=self.node_id))
            return False
        mine[device] = until or now + 24 * 3600.0
        self._by_job[job] = mine
        log.warning("device %d set aside%s: %s", device,
                    f" for {self.cooldown_s:.0f}s" if self.cooldown_s else " until elasticctl uncordon --device",
                    record.reason, extra=dict(job=job, node=self.node_id))
        return True

    async def watch(self, kind: str, ids: tuple[int, ...], every_s: float, stop: asyncio.Event) -> None:
        """Every ``every_s`` until ``stop``: ask the node's tools again; a device of ``ids`` they no
        longer show is set aside until uncordoned (once; it may come back, an operator says when).
        Nothing is watched where the tools showed none of ``kind`` at the start (a listed inventory
        on a node without them)."""
        first_kind, first, _ = await asyncio.to_thread(inventory.detect)
        if not every_s or first_kind != kind or not set(ids) <= set(first):
            return
        gone: set[int] = set()
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            if stop.is_set():
                return
            found_kind, found, how = await asyncio.to_thread(inventory.detect)
            missing = set(ids) - set(found if found_kind == kind else ())
            for device in sorted(missing - gone):
                reason = f"gone from {how or 'the node'} (it shows {format_ids(found) or 'none'})"
                record = DeviceCordon(self.node_id, device, reason, time.time())
                try:
                    await self.store.put(self.store.keys.device_cordon(self.node_id, device), record.to_json())
                except TemporaryError as e:
                    log.error("device %d, gone, not set aside (etcd unavailable: %s)", device, e,
                              extra=dict(node=self.node_id))
                    continue
                gone.add(device)
                log.error("device %s %d %s: set aside until elasticctl uncordon %s --device %d", kind, device, reason,
                          self.node_id, device, extra=dict(node=self.node_id))
            gone &= missing  # (one back is set aside again if it goes again)
