"""NVIDIA's Xid events (issue #32) as NVML reports them: a critical Xid on one of this node's GPUs
(uncorrectable ECC, fallen off the bus, row remapping failed, ...) sets that GPU aside, the way a
GPU gone from ``nvidia-smi -L`` is; a rank that fails on it meanwhile fails for its device (cause
DEVICE: the node is not blamed). See :meth:`mselastic.agent.devices.health.DeviceHealth.xid`.

Read the way NVIDIA's device plugin reads them: one event set with every GPU's critical Xid events
(those a GPU supports; a GPU that cannot register is said and the others are read), waited on in a
thread of its own (NVML blocks), half a second a wait so that the thread ends soon after elasticd
asks it to. The Xids that mean a job's kernel faulted on a sound GPU (:data:`APPLICATION_XIDS`,
the plugin's list) are logged and left alone. NVML comes from ``nvidia-ml-py`` (``pynvml``); a node
without NVIDIA's driver has no NVML to load, and nothing is read there. NVML failing later (a
driver upgraded under elasticd) is said, and the reading starts again with a backoff."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from types import ModuleType
from typing import Awaitable, Callable

import tenacity

from mselastic.core import retries

log = logging.getLogger(__name__)

#: Xids that a job's own code causes on a sound GPU (graphics engine exception, GPU memory page
#: fault, stopped processing, preemptive clean-up, video processor exception, context switch
#: timeout): NVIDIA's device plugin ignores them too.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
#: Xids NVIDIA's Xid catalogue puts on the hardware alone (double-bit ECC, row remapping, NVLink,
#: fallen off the bus, ECC rates and contained/uncontained errors, GSP, unrecovered ECC): they set
#: a GPU aside for no job. Any other is counted against the job that uses the GPU (its cap).
HARDWARE_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
#: One wait for events, in milliseconds (the thread looks whether it should end between two).
WAIT_MS = 500
#: NVML's codes for "no driver here": nothing to read, nothing to try again.
NO_DRIVER = frozenset({9, 12})  # NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND


class Ended(Exception):
    """The reading of NVML's events ended (why); it starts again after a while."""


class Lasted(Exception):
    """The reading of NVML's events ended after it had read for :data:`LASTED_S` (why): it starts
    again after a second, the backoff over."""


#: A reading that read this long before it ended starts the backoff over.
LASTED_S = 60.0


def read_events(nvml: ModuleType, ids: tuple[int, ...], emit: Callable[[int, int], None],
                stopped: threading.Event, ready: Callable[[list[int], dict[int, str]], None]) -> None:
    """In a thread of its own, until ``stopped``: register the critical Xid events of the GPUs
    ``ids`` (NVML's indexes, nvidia-smi's), call ``ready`` with those registered and why the
    others are not, then ``emit(index, xid)`` for each event. Raises ``nvml.NVMLError`` when NVML
    cannot be read."""
    nvml.nvmlInit()
    try:
        events = nvml.nvmlEventSetCreate()
        try:
            registered, failed = [], {}
            for index in ids:
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    mask = nvml.nvmlEventTypeXidCriticalError & nvml.nvmlDeviceGetSupportedEventTypes(handle)
                    if not mask:
                        failed[index] = "it reports no Xid events"
                        continue
                    nvml.nvmlDeviceRegisterEvents(handle, mask, events)
                    registered.append(index)
                except nvml.NVMLError as e:
                    failed[index] = str(e)
            ready(registered, failed)
            while not stopped.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(events, WAIT_MS)
                except nvml.NVMLError as e:
                    if getattr(e, "value", None) == nvml.NVML_ERROR_TIMEOUT:
                        continue
                    raise
                if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                    emit(nvml.nvmlDeviceGetIndex(data.device), int(data.eventData))
        finally:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(events)
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


async def watch(kind: str, ids: tuple[int, ...], on_xid: Callable[[int, int], Awaitable[None]],
                stop: asyncio.Event) -> None:
    """Until ``stop``: ``on_xid(gpu, xid)`` for each critical Xid NVML reports on one of ``ids``
    (a node of ``kind`` gpu), the application Xids left out. Returns at once where there is no NVML
    (no nvidia-ml-py, no driver); NVML failing later is said, and the reading starts again (1 s,
    doubling to a minute between tries; once a reading has lasted a minute, from 1 s again)."""
    if kind != "gpu" or not ids:
        return
    try:
        import pynvml
    except ImportError:
        log.warning("nvidia-ml-py is not installed: NVML's Xid events are not read (pip install nvidia-ml-py)")
        return

    def said(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.warning("NVML's Xid events are not read (%s); trying again in %.0fs", error,
                    state.next_action.sleep if state.next_action else 0)

    while not stop.is_set():  # (a reading that lasted starts the backoff over: a new retrier)
        with contextlib.suppress(Ended):  # (asked to stop meanwhile)
            try:
                async for attempt in retries.backing_off(Ended, first_s=1, max_s=60, done=stop.is_set,
                                                         before_sleep=said):
                    with attempt:
                        await _read(pynvml, ids, on_xid, stop)
                return  # (asked to stop, or no driver)
            except Lasted as e:
                log.warning("NVML's Xid events are not read (%s); trying again in 1s", e)
                await asyncio.sleep(1)


async def _read(nvml: ModuleType, ids: tuple[int, ...], on_xid: Callable[[int, int], Awaitable[None]],
                stop: asyncio.Event) -> None:
    """One reading, until ``stop`` (or no driver: returns); :class:`Ended` when NVML fails
    (:class:`Lasted` when it had read for a while first)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, int] | BaseException] = asyncio.Queue()  # (GPU, Xid), or why it ended

    def put(item: tuple[int, int] | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # (the loop closed: elasticd is gone)
            loop.call_soon_threadsafe(events.put_nowait, item)

    def ready(gpus: list[int], failed: dict[int, str]) -> None:
        log.info("NVML's Xid events read for GPUs %s", ",".join(map(str, gpus)) or "none")
        for gpu, why in sorted(failed.items()):
            log.warning("GPU %d: its Xid events cannot be read: %s", gpu, why)

    def run() -> None:
        try:
            read_events(nvml, ids, lambda gpu, xid: put((gpu, xid)), stopped, ready)
        except Exception as e:  # noqa: BLE001 - said on the loop
            put(e)

    if stop.is_set():
        return
    stopped = threading.Event()
    started = loop.time()
    threading.Thread(target=run, name="nvml-xid", daemon=True).start()
    try:
        while not stop.is_set():
            got, ended = asyncio.ensure_future(events.get()), asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait([got, ended], return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
                got.cancel()
            if not got.done() or got.cancelled():
                return
            event = got.result()
            if isinstance(event, BaseException):
                if getattr(event, "value", None) in NO_DRIVER:
                    log.info("NVML's Xid events are not read here: %s (no NVIDIA driver)", event)
                    return
                why = f"{type(event).__name__}: {event}"
                raise Lasted(why) if loop.time() - started >= LASTED_S else Ended(why)
            gpu, xid = event
            if gpu not in ids:
                continue
            if xid in APPLICATION_XIDS:
                log.info("Xid %d on GPU %d: a job's fault, not the GPU's; nothing set aside", xid, gpu)
                continue
            await on_xid(gpu, xid)
    finally:
        stopped.set()
