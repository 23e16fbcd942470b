"""A stand-in for nvidia-ml-py's ``pynvml`` on a machine without NVIDIA's driver: the names
mselastic.agent.devices.xid uses, with nvidia-ml-py 13's values. The GPUs are those the file ``gpus`` in
``$FAKE_NVML_DIR`` names; each line "GPU XID" appended to the file ``xids`` there is one critical
Xid event (what the driver would report), a line "lost" NVML failing (GPU_IS_LOST) once. Tests
put this folder first on elasticd's PYTHONPATH."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypeXidCriticalError = 0x8


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


_state: dict[str, int] = {}


def _path(name: str) -> str:
    return os.path.join(os.environ["FAKE_NVML_DIR"], name)


def nvmlInit() -> None:
    if not os.path.exists(_path("gpus")):
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    _state.setdefault("read", 0)  # (every line of the file is an event, once: none is missed before a wait)


def nvmlShutdown() -> None:
    pass


def nvmlEventSetCreate() -> SimpleNamespace:
    return SimpleNamespace(devices=set())


def nvmlEventSetFree(events: SimpleNamespace) -> None:
    events.devices.clear()


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    with open(_path("gpus")) as f:
        if str(index) not in f.read().split():
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return index


def nvmlDeviceGetIndex(handle: int) -> int:
    return handle


def nvmlDeviceGetSupportedEventTypes(handle: int) -> int:
    return nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeSingleBitEccError


def nvmlDeviceRegisterEvents(handle: int, types: int, events: SimpleNamespace) -> None:
    events.devices.add(handle)


def nvmlEventSetWait_v2(events: SimpleNamespace, timeout_ms: int) -> SimpleNamespace:
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        try:
            with open(_path("xids"), "rb") as f:
                f.seek(_state["read"])
                line = f.readline()
        except FileNotFoundError:
            line = b""
        if line.endswith(b"\n"):
            _state["read"] += len(line)
            if line.strip() == b"lost":
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            gpu, xid = map(int, line.split())
            if gpu in events.devices:
                return SimpleNamespace(device=gpu, eventType=nvmlEventTypeXidCriticalError, eventData=xid)
            continue
        if time.monotonic() >= deadline:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        time.sleep(0.02)
