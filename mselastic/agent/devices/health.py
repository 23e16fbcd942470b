"""A device set aside (issue #32): when a failed rank's log names its device, this node's agent
writes ``cordons/<node>/devices/<id>`` (see :class:`mselastic.core.model.DeviceCordon`) before the
failure is reported, so that the relaunch the leader plans leaves that device out and the node
keeps serving with the others. The log is the job's own words: one job may hold at most
:data:`MAX_BY_ONE_JOB` devices of a node aside at once, counted from etcd's records (past that, its
failures stay its ranks'), so that a job cannot take a node's devices from the others by writing
such lines. A device that the node's tools stop showing while elasticd runs
(:meth:`DeviceHealth.watch`) is set aside until an operator puts it back; a GPU NVML reports a
critical Xid on (:mod:`mselastic.agent.devices.xid`) for ``device_cooldown_s``. :func:`evidence` says which
device a failure is, if any. A device check (``device_check``, a short command run with
the visible-devices variable naming one device) runs before a generation uses a device that was
set aside (or every generation's devices, ``device_check_every_generation``); a device that fails
it is set aside again, and the launch fails with cause DEVICE (the node not blamed). Before a
launch, :func:`unfit` says whether the plan's devices are this node's and free here."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from typing import Awaitable, Callable


from mselastic.agent.devices import detect as inventory
from mselastic.agent.devices import xid as xids
from mselastic.agent.containment.cgroups import Group, join_prefix
from mselastic.agent.containment.jobfiles import bounded, read_tail
from mselastic.agent.containment.users import WorkerUser, inherited_env, setpriv
from mselastic.core import retries
from mselastic.core.devices import LOG_TAIL_BYTES, device_error, format_ids, visible_env
from mselastic.core.model import DeviceCordon, MalformedRecord, Member
from mselastic.core.waits import within
from mselastic.store.etcd import PermanentError, Store, TemporaryError

log = logging.getLogger(__name__)

#: Devices of a node one job may hold aside at once.
MAX_BY_ONE_JOB = 2
#: Looks in a row a device must be missing from the node's tools before it is set aside.
MISSES = 2
#: How long setting a failed rank's device aside may hold the failure's report (an etcd write).
DEVICE_ASIDE_S = 5.0
#: How long a critical Xid on a GPU blames that GPU for a rank that fails on it.
XID_BLAMES_S = 300.0
#: The same Xid on the same GPU within this long is not written again (a storm of them is one).
XID_REPEAT_S = 5.0
#: How long the Xids' writes under way may take once elasticd is stopping.
WRITES_AT_STOP_S = 3.0


@dataclasses.dataclass(frozen=True)
class SeenXid:
    """NVML's last critical Xid on a GPU: when, which, and the write that sets the GPU aside."""

    at: float
    xid: int
    written: asyncio.Future[bool]


async def evidence(blame: Callable[[int, str], Awaitable[str]], member: Member, index: int, log_path: str,
                   ctx: dict[str, object]) -> tuple[int, str, str]:
    """Ranks of ``member`` failed (the ``index``-th of its local ranks first, whose log is
    ``log_path``: -1, none of them): (the device that shows it failed, whose it is, why) or
    (-1, "", ""). The failed rank's own device first: the last line at the end of its log that
    names a device error (see core.devices.device_error); then every device of the member, by what
    ``blame`` (:meth:`DeviceHealth.blame`, bound to the job) says, :data:`DEVICE_ASIDE_S` each."""
    mine, line = (member.devices[index] if 0 <= index < len(member.devices) else -1), ""
    if mine >= 0:
        try:  # (the job's file: read as jobfiles reads them)
            line = device_error((await bounded(read_tail, log_path, LOG_TAIL_BYTES)).decode(errors="replace"))
        except OSError as e:
            log.debug("%s not read for a device error: %s", log_path, e, extra=ctx)
        if line:
            log.warning("the failed rank's log names its device %s %d: %s", member.device_kind, mine, line, extra=ctx)
    for device in sorted(member.devices, key=lambda d: d != mine):
        try:
            why = await within(blame(device, line if device == mine else ""), DEVICE_ASIDE_S)
        except (asyncio.TimeoutError, OSError, RuntimeError) as e:
            log.error("device %d not set aside: %r", device, e, extra=ctx)
            continue
        if why:
            return device, "its device" if device == mine else "a device of this member", why
    return -1, "", ""


def unfit(member: Member, kind: str, ids: tuple[int, ...], running: dict[str, tuple[int, ...]]) -> tuple[bool, str]:
    """Why this node must not launch ``member`` with its devices ((True, why): for good, the plan
    is wrong for this node; (False, why): for now; (False, ""): it may), given this node's device
    ``kind`` and ``ids`` and the devices of the other jobs' generations not over here (``running``,
    by job): a plan never puts a rank on a device another job's rank still uses, whatever the
    leader's records say (a generation it no longer reads may still be stopping there)."""
    if not ids:
        if member.devices:
            return True, f"the plan gives this node devices {format_ids(member.devices)}; it has none (devices unset)"
        return False, ""
    if not member.devices:
        return True, (f"the plan gives this node's ranks no devices; it has {kind} devices {format_ids(ids)} (a "
                      f"leader that does not assign devices? upgrade it)")
    if member.device_kind != kind or not set(member.devices) <= set(ids):
        return True, (f"the plan gives this node {member.device_kind or 'unknown'} devices "
                      f"{format_ids(member.devices)}; it has {kind} devices {format_ids(ids)}")
    for job, used in sorted(running.items()):
        if shared := set(used) & set(member.devices):
            return False, (f"devices {format_ids(sorted(shared))} are still used by job {job}'s generation here; "
                           f"launched once it has ended")
    return False, ""


@dataclasses.dataclass(frozen=True)
class DeviceCheck:
    """The check a device passes before a generation uses it ("" command: none)."""

    command: str = ""
    every_generation: bool = False
    timeout_s: float = 5.0


class DeviceHealth:
    """Sets this node's devices aside on a failed rank's evidence, on their disappearance, and on a
    failed check (see the module's notes). What is aside lives in etcd only (``cordons/<node>/
    devices/<id>``, with the job it was set aside for): the per-job cap counts those, and survives
    a restart of elasticd."""

    def __init__(self, store: Store, node_id: str, cooldown_s: float, check: DeviceCheck = DeviceCheck(),
                 user_of: Callable[[int], str] = lambda device: "") -> None:
        self.store, self.node_id, self.cooldown_s, self.check_rule = store, node_id, cooldown_s, check
        #: The job whose rank uses a device here ("" none).
        self.user_of = user_of
        self._xids: dict[int, list[SeenXid]] = {}  # GPU -> NVML's critical Xids on it, oldest first
        self._writes: set[asyncio.Future[bool]] = set()

    async def _records(self) -> dict[int, DeviceCordon]:
        """This node's device cordons in etcd, by device (malformed ones left out)."""
        prefix = self.store.keys.device_cordon(self.node_id, 0)[:-1]
        _, kvs = await self.store.get_prefix(prefix)
        found = {}
        for kv in kvs:
            with contextlib.suppress(MalformedRecord):
                rec = DeviceCordon.from_json(kv.value)
                found[rec.device] = rec
        return found

    async def _aside(self, record: DeviceCordon) -> None:
        """Write ``record``, unless the device is aside already for good (``until`` 0: an operator's,
        a device gone), or for longer: the stronger record is kept. A device aside for no job (the
        hardware's word, an operator's) stays so for no job: no job's cap pays for it."""
        key = self.store.keys.device_cordon(self.node_id, record.device)
        kv = await self.store.get(key)
        if kv is not None:
            with contextlib.suppress(MalformedRecord):
                old = DeviceCordon.from_json(kv.value)
                if old.held(record.since) and (not old.until or (record.until and old.until >= record.until)):
                    return
                if old.held(record.since) and not old.job:
                    record = dataclasses.replace(record, job="")
        await self.store.put(key, record.to_json())

    async def _may_blame(self, job: str, device: int, now: float) -> bool:
        """Whether ``job`` may set ``device`` aside: it holds fewer than :data:`MAX_BY_ONE_JOB` of
        this node's devices aside now (as etcd says)."""
        held = {d for d, rec in (await self._records()).items() if rec.job == job and rec.held(now) and d != device}
        if len(held) < MAX_BY_ONE_JOB:
            return True
        log.warning("job %s holds devices %s of this node aside already: device %d is not set aside; the failure "
                    "counts as its rank's", job, format_ids(sorted(held)), device, extra=dict(job=job, node=self.node_id))
        return False

    async def set_aside(self, job: str, device: int, line: str) -> bool:
        """Set ``device`` aside for ``job``'s failed rank whose log says ``line``; False when the job
        holds too many aside here already, or etcd cannot be written (the failure stays the rank's)."""
        now = time.time()
        try:
            if not await self._may_blame(job, device, now):
                return False
            until = now + self.cooldown_s if self.cooldown_s else 0.0
            record = DeviceCordon(self.node_id, device, f"job {job}: {line}"[:400], now, until, job)
            await self._aside(record)
        except (TemporaryError, PermanentError) as e:
            log.error("device %d not set aside (etcd: %s)", device, e, extra=dict(node=self.node_id))
            return False
        log.warning("device %d set aside%s: %s", device,
                    f" for {self.cooldown_s:.0f}s" if self.cooldown_s else " until elasticctl uncordon --device",
                    record.reason, extra=dict(job=job, node=self.node_id))
        return True

    async def blame(self, job: str, device: int, line: str) -> str:
        """What shows that ``job``'s rank failed for its ``device`` ("" nothing): the last line of its
        log naming a device error (``line``) once the device is set aside for it (the job's words:
        within its cap), or a critical Xid NVML reported on the device in the last
        :data:`XID_BLAMES_S` that set it aside, while it is aside (not uncordoned since; a record
        that replaced the Xid's, the device gone, counts). Bounded: 2 s for an Xid's write under
        way, 1.5 s to read etcd again (NVML's word stands when etcd does not answer)."""
        if line and await self.set_aside(job, device, line):
            return f"its log names it, set aside: {line}"
        now = time.time()
        for seen in reversed(self._xids.get(device, [])):
            if now - seen.at > XID_BLAMES_S:
                break
            done, _ = await asyncio.wait({seen.written}, timeout=2.0)
            if seen.written.cancelled() or (done and not seen.written.result()):
                continue  # (not written: the job's cap, etcd away for a minute)
            said = f"NVML reported Xid {seen.xid} on it at {time.strftime('%H:%M:%S', time.localtime(seen.at))}"
            if not done:
                return f"{said} (being set aside: etcd is slow)"
            try:
                record = (await within(self._records(), 1.5)).get(device)
            except (TemporaryError, PermanentError, asyncio.TimeoutError):
                pass  # (etcd away: NVML's word stands)
            else:
                if record is None or not record.held(time.time()):
                    return ""  # (uncordoned since)
            return f"{said}, set aside"
        return ""

    async def xid(self, device: int, xid: int) -> None:
        """NVML reported critical Xid ``xid`` on GPU ``device``: set it aside (``device_cooldown_s``;
        its check runs before a generation uses it again), in the background (a rank failing
        meanwhile waits for it in :meth:`blame`). One of :data:`mselastic.agent.devices.xid.HARDWARE_XIDS`
        for no job; another counts against the job whose rank uses the GPU here (its cap: a job's
        code might make the driver say so). The same Xid on a GPU again within
        :data:`XID_REPEAT_S` is not written again."""
        now = time.time()
        seen = [x for x in self._xids.get(device, []) if now - x.at <= XID_BLAMES_S]
        if seen and now - seen[-1].at < XID_REPEAT_S and seen[-1].xid == xid:
            log.info("GPU %d: Xid %d again", device, xid, extra=dict(node=self.node_id))
            return
        job = "" if xid in xids.HARDWARE_XIDS else self.user_of(device)
        record = DeviceCordon(self.node_id, device, f"Xid {xid} reported by NVML", now,
                              now + self.cooldown_s if self.cooldown_s else 0.0, job)
        task = asyncio.ensure_future(self._write_xid(record, xid))
        self._xids[device] = [*seen, SeenXid(now, xid, task)]
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_xid(self, record: DeviceCordon, xid: int) -> bool:
        """Write ``record`` (an Xid's), etcd tried again for a minute; whether it was."""
        extra = dict(node=self.node_id, job=record.job or "-")
        try:
            if record.job and not await self._may_blame(record.job, record.device, record.since):
                return False
            async for attempt in retries.backing_off(TemporaryError, first_s=0.5, max_s=5, within_s=60):
                with attempt:
                    await self._aside(record)
        except (TemporaryError, PermanentError) as e:
            log.error("GPU %d: Xid %d reported by NVML; not set aside (etcd: %s)", record.device, xid, e, extra=extra)
            return False
        log.error("GPU %d: Xid %d reported by NVML: set aside %s%s", record.device, xid,
                  f"for {self.cooldown_s:.0f}s" if self.cooldown_s else "until elasticctl uncordon --device",
                  f" (counted against job {record.job}, whose rank uses it)" if record.job else "", extra=extra)
        return True

    async def check(self, job: str, devices: tuple[int, ...], kind: str, user: WorkerUser | None,
                    group: Group | None) -> tuple[int, str, bool] | None:
        """Run the device check on each of ``devices`` that needs it (every one with
        ``every_generation``, else those with a cordon record, held or not: set aside once), side by
        side, as ``user`` in ``group`` (the generation's cgroup), the visible-devices variable naming
        that device alone and DEVICE_ID 0. The first that fails is set aside (for ``job``, within its
        cap): (its id, why, whether it was set aside), else None. A device that passes has its expired
        record removed."""
        rule = self.check_rule
        if not rule.command or not devices:
            return None
        now = time.time()
        records = await self._records()
        todo = [d for d in devices if rule.every_generation or d in records]
        if not todo:
            return None
        results = await asyncio.gather(*(self._run(d, kind, user, group) for d in todo))
        for device, why in zip(todo, results):
            if not why:
                log.info("device %s %d passed its check", kind, device, extra=dict(node=self.node_id))
                rec = records.get(device)
                if rec is not None and not rec.held(now):
                    with contextlib.suppress(TemporaryError):
                        await self.store.delete(self.store.keys.device_cordon(self.node_id, device))
        for device, why in zip(todo, results):
            if why:
                record = DeviceCordon(self.node_id, device, f"device check failed: {why}"[:400], now,
                                      now + self.cooldown_s if self.cooldown_s else 0.0, job)
                try:
                    aside = await self._may_blame(job, device, now)
                    if aside:
                        await self._aside(record)
                except (TemporaryError, PermanentError) as e:
                    log.error("device %d not set aside (etcd: %s)", device, e, extra=dict(node=self.node_id))
                    aside = False
                log.warning("device %s %d failed its check: %s%s", kind, device, why, "; set aside" if aside else "",
                            extra=dict(job=job, node=self.node_id))
                return device, why, aside
        return None

    async def _run(self, device: int, kind: str, user: WorkerUser | None, group: Group | None) -> str:
        """"" when the check passed on ``device``; else why not (its last line of output, its code).
        It runs in a session of its own: killed with everything it started when late, or when the
        launch is cancelled."""
        cmd = ["/bin/sh", "-c", self.check_rule.command]
        if user is not None and user.switch:
            cmd = [*setpriv(user), *cmd]
        cmd = [*join_prefix([group] if group else []), *cmd]
        env = {**inherited_env(os.environ), "DEVICE_ID": "0", **visible_env(kind, (device,))}
        try:
            proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd="/", stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            return f"cannot run it: {e}"
        try:
            out, _ = await within(proc.communicate(), self.check_rule.timeout_s)
        except asyncio.TimeoutError:
            return f"no answer within {self.check_rule.timeout_s:g}s"
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.shield(proc.wait())
        if proc.returncode == 0:
            return ""
        last = next((line for line in reversed(out.decode(errors="replace").splitlines()) if line.strip()), "")
        return f"exit code {proc.returncode}" + (f": {last.strip()[:200]}" if last else "")

    async def watch(self, kind: str, ids: tuple[int, ...], every_s: float, stop: asyncio.Event) -> None:
        """Until ``stop``: NVML's critical Xid events on a GPU (see :mod:`mselastic.agent.devices.xid`), and
        every ``every_s`` the node's tools asked again: a device of ``ids`` they no longer show, twice
        in a row, while they show others of ``kind`` (a tool that fails or shows none proves
        nothing), is set aside until uncordoned. Errors are logged, the watch goes on."""
        try:
            for what, result in zip(("NVML's Xid events", "the devices' look"), await asyncio.gather(
                    xids.watch(kind, ids, self.xid, stop), self._look_every(kind, ids, every_s, stop),
                    return_exceptions=True)):
                if isinstance(result, Exception):
                    log.error("%s stopped: %r", what, result, extra=dict(node=self.node_id))
        finally:
            if self._writes:  # (an Xid's record reaches etcd if it can: elasticd restarted remembers it)
                await asyncio.wait(list(self._writes), timeout=WRITES_AT_STOP_S)
            for task in list(self._writes):
                task.cancel()

    async def _look_every(self, kind: str, ids: tuple[int, ...], every_s: float, stop: asyncio.Event) -> None:
        if not ids or not every_s:
            return
        misses: dict[int, int] = {}
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await within(stop.wait(), every_s)
            if stop.is_set():
                return
            try:
                await self._look(kind, ids, misses)
            except Exception:  # noqa: BLE001 - logged; the next look may do better
                log.exception("devices not looked at this time", extra=dict(node=self.node_id))

    async def _look(self, kind: str, ids: tuple[int, ...], misses: dict[int, int]) -> None:
        found_kind, found, how = await asyncio.to_thread(inventory.detect)
        if found_kind != kind or not found:
            log.debug("the node's tools show no %s devices this time: nothing concluded", kind)
            return
        for device in ids:
            misses[device] = misses.get(device, 0) + 1 if device not in found else 0
            if misses[device] != MISSES:
                continue
            reason = f"gone from {how} (it shows {format_ids(found)})"
            try:
                await self._aside(DeviceCordon(self.node_id, device, reason, time.time()))
            except TemporaryError as e:
                log.error("device %d, gone, not set aside (etcd unavailable: %s)", device, e,
                          extra=dict(node=self.node_id))
                misses[device] -= 1  # (tried again at the next look)
                continue
            log.error("device %s %d %s: set aside until elasticctl uncordon %s --device %d", kind, device, reason,
                      self.node_id, device, extra=dict(node=self.node_id))
