"""A device set aside (issue #32): when a failed rank's log names its device, this node's agent
writes ``cordons/<node>/devices/<id>`` (see :class:`mselastic.core.model.DeviceCordon`) before the
failure is reported, so that the relaunch the leader plans leaves that device out and the node
keeps serving with the others. The log is the job's own words: one job may set aside at most
:data:`MAX_BY_ONE_JOB` devices of a node within a cooldown (past that, its failures stay its
ranks'), so that a job cannot take a node's devices from the others by writing such lines. A
device that the node's tools stop showing while elasticd runs (:meth:`DeviceHealth.watch`) is set
aside until an operator puts it back. A device check (``device_check``, a short command run with
the visible-devices variable naming one device) runs before a generation uses a device that was
set aside (or every generation's devices, ``device_check_every_generation``); a device that fails
it is set aside again, and the launch fails with cause DEVICE (the node not blamed)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from mselastic.agent import devices as inventory
from mselastic.agent.cgroups import Group, join_prefix
from mselastic.agent.users import WorkerUser, setpriv
from mselastic.core.devices import format_ids, visible_env
from mselastic.core.model import DeviceCordon
from mselastic.store.etcd import Store, TemporaryError

log = logging.getLogger(__name__)

#: Devices of a node one job may set aside within a cooldown.
MAX_BY_ONE_JOB = 2


@dataclasses.dataclass(frozen=True)
class DeviceCheck:
    """The check a device passes before a generation uses it ("" command: none)."""

    command: str = ""
    every_generation: bool = False
    timeout_s: float = 30.0


class DeviceHealth:
    """Sets this node's devices aside on a failed rank's evidence, on their disappearance, and on a
    failed check (see the module's notes)."""

    def __init__(self, store: Store, node_id: str, cooldown_s: float, check: DeviceCheck = DeviceCheck()) -> None:
        self.store, self.node_id, self.cooldown_s, self.check_rule = store, node_id, cooldown_s, check
        #: Per job, the devices it set aside here, and until when they count.
        self._by_job: dict[str, dict[int, float]] = {}
        #: Devices set aside here, or found set aside at the start: checked before they are used again.
        self.suspect: set[int] = set()

    async def check(self, devices: tuple[int, ...], kind: str, user: WorkerUser | None,
                    group: Group | None) -> tuple[int, str] | None:
        """Run the device check on each of ``devices`` that needs it (as ``user``, in the
        generation's cgroup ``group``, with the visible-devices variable naming that device alone and
        DEVICE_ID 0); the first that fails is set aside again: (its id, why), else None."""
        rule = self.check_rule
        for device in (d for d in devices if rule.command and (rule.every_generation or d in self.suspect)):
            why = await self._run(device, kind, user, group)
            if not why:
                self.suspect.discard(device)
                log.info("device %s %d passed its check", kind, device, extra=dict(node=self.node_id))
                continue
            now = time.time()
            record = DeviceCordon(self.node_id, device, f"device check failed: {why}"[:400], now,
                                  now + self.cooldown_s if self.cooldown_s else 0.0)
            with contextlib.suppress(TemporaryError):  # (the launch fails anyway: cause DEVICE)
                await self.store.put(self.store.keys.device_cordon(self.node_id, device), record.to_json())
            self.suspect.add(device)
            log.warning("device %s %d set aside: %s", kind, device, record.reason, extra=dict(node=self.node_id))
            return device, why
        return None

    async def _run(self, device: int, kind: str, user: WorkerUser | None, group: Group | None) -> str:
        """"" when the check passed on ``device``; else why not (its last line of output, its code)."""
        cmd = ["/bin/sh", "-c", self.check_rule.command]
        if user is not None and user.switch:
            cmd = [*setpriv(user), *cmd]
        cmd = [*join_prefix([group] if group else []), *cmd]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "DEVICE_ID": "0", **visible_env(kind, (device,))}
        try:
            proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd="/", stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
        except OSError as e:
            return f"cannot run it: {e}"
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.check_rule.timeout_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return f"no answer within {self.check_rule.timeout_s:g}s"
        if proc.returncode == 0:
            return ""
        last = next((line for line in reversed(out.decode(errors="replace").splitlines()) if line.strip()), "")
        return f"exit code {proc.returncode}" + (f": {last.strip()[:200]}" if last else "")

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
        self.suspect.add(device)
        log.warning("device %d set aside%s: %s", device,
                    f" for {self.cooldown_s:.0f}s" if self.cooldown_s else " until elasticctl uncordon --device",
                    record.reason, extra=dict(job=job, node=self.node_id))
        return True

    async def watch(self, kind: str, ids: tuple[int, ...], every_s: float, stop: asyncio.Event) -> None:
        """Every ``every_s`` until ``stop``: ask the node's tools again; a device of ``ids`` they no
        longer show is set aside until uncordoned (once; it may come back, an operator says when).
        Nothing is watched where the tools showed none of ``kind`` at the start (a listed inventory
        on a node without them)."""
        if not ids:
            return
        with contextlib.suppress(TemporaryError):  # (those set aside before this elasticd: checked first too)
            _, found_aside = await self.store.get_prefix(self.store.keys.device_cordon(self.node_id, 0)[:-1])
            self.suspect |= {int(kv.key.rsplit("/", 1)[1]) for kv in found_aside if kv.key.rsplit("/", 1)[1].isdigit()}
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
                self.suspect.add(device)
                log.error("device %s %d %s: set aside until elasticctl uncordon %s --device %d", kind, device, reason,
                          self.node_id, device, extra=dict(node=self.node_id))
            gone &= missing  # (one back is set aside again if it goes again)
