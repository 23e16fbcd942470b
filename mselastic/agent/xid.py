"""NVIDIA's Xid events (issue #32) as NVML reports them: a critical Xid on one of this node's GPUs
(uncorrectable ECC, fallen off the bus, row remapping failed, ...) sets that GPU aside, the way a
GPU gone from ``nvidia-smi -L`` is; a rank that fails on it meanwhile fails for its device (cause
DEVICE: the node is not blamed).

Read the way NVIDIA's device plugin reads them: one event set with every GPU's critical Xid events
(those a GPU supports), waited on in a thread of its own (NVML blocks), a short wait at a time so
that the thread ends soon after elasticd asks it to. The Xids that mean a job's kernel faulted on a
sound GPU (:data:`APPLICATION_XIDS`, the plugin's list) are logged and left alone: a job must not
take a node's GPUs from the others by faulting. NVML comes from ``nvidia-ml-py`` (``pynvml``); a
node without NVIDIA's driver has no NVML to load, and nothing is read there."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from types import ModuleType
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

#: Xids that a job's own code causes on a sound GPU (graphics engine exception, GPU memory page
#: fault, stopped processing, preemptive clean-up, video processor exception, context switch
#: timeout): NVIDIA's device plugin ignores them too.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
#: One wait for events, in milliseconds (the thread looks whether it should end between two).
WAIT_MS = 500


def read_events(nvml: ModuleType, ids: tuple[int, ...], emit: Callable[[int, int], None],
                stopped: threading.Event, ready: Callable[[list[int]], None]) -> None:
    """In a thread of its own, until ``stopped``: register the critical Xid events of the GPUs
    ``ids`` (NVML's indexes, nvidia-smi's), call ``ready`` with those that have them, then
    ``emit(index, xid)`` for each event. Raises ``nvml.NVMLError`` when NVML cannot be read."""
    nvml.nvmlInit()
    try:
        events = nvml.nvmlEventSetCreate()
        try:
            registered = []
            for index in ids:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                mask = nvml.nvmlEventTypeXidCriticalError & nvml.nvmlDeviceGetSupportedEventTypes(handle)
                if mask:
                    nvml.nvmlDeviceRegisterEvents(handle, mask, events)
                    registered.append(index)
            ready(registered)
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
    (no nvidia-ml-py, no driver); NVML failing later is logged and the watch ends (the other
    evidence, a rank's log and the devices the tools show, still holds)."""
    if kind != "gpu" or not ids:
        return
    try:
        import pynvml
    except ImportError:
        log.warning("nvidia-ml-py is not installed: NVML's Xid events are not read (pip install nvidia-ml-py)")
        return
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, int] | str] = asyncio.Queue()  # (GPU, Xid), or why the reading ended
    stopped, registered = threading.Event(), threading.Event()

    def emit(index: int, xid: int) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (index, xid))

    def ready(gpus: list[int]) -> None:
        registered.set()
        others = sorted(set(ids) - set(gpus))
        log.info("NVML's Xid events read for GPUs %s%s", ",".join(map(str, gpus)) or "none",
                 f" (GPUs {','.join(map(str, others))} report none)" if others else "")

    def run() -> None:
        try:
            read_events(pynvml, ids, emit, stopped, ready)
        except Exception as e:  # noqa: BLE001 - said on the loop; the watch ends
            loop.call_soon_threadsafe(events.put_nowait, f"{type(e).__name__}: {e}")

    threading.Thread(target=run, name="nvml-xid", daemon=True).start()
    try:
        while not stop.is_set():
            got = asyncio.ensure_future(events.get())
            ended = asyncio.ensure_future(stop.wait())
            await asyncio.wait([got, ended], return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
            if not got.done():
                got.cancel()
                return
            event = got.result()
            if isinstance(event, str):
                if registered.is_set():
                    log.warning("NVML's Xid events are no longer read: %s", event)
                else:  # (no driver: nothing to read, the other evidence holds)
                    log.info("NVML's Xid events are not read here: %s", event)
                return
            gpu, xid = event
            if gpu not in ids:
                continue
            if xid in APPLICATION_XIDS:
                log.info("Xid %d on GPU %d: a job's fault, not the GPU's; nothing set aside", xid, gpu)
                continue
            await on_xid(gpu, xid)
    finally:
        stopped.set()
