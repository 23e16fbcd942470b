"""NVML's Xid events (issue #32), read through tests/fake_nvml's pynvml (nvidia-ml-py's names on a
machine without NVIDIA's driver): which events set a GPU aside, and that the reading ends when
asked and says why it ends otherwise (the whole path under elasticd: tests/integration/test_devices.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import threading
from types import ModuleType
from typing import Any

import pytest

from mselastic.agent.devices import xid

FAKE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fake_nvml", "pynvml.py")


@pytest.fixture
def nvml(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    spec = importlib.util.spec_from_file_location("pynvml", FAKE)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setenv("FAKE_NVML_DIR", str(tmp_path))
    (tmp_path / "gpus").write_text("0 1 2 3\n")
    return str(tmp_path)


def watched(nvml: str, events: str) -> list[tuple[int, int]]:
    """The (GPU, Xid) the watch of GPUs 0-3 hands on, the stand-in reporting ``events`` (its lines),
    until Xid 48 comes."""
    seen: list[tuple[int, int]] = []

    async def run() -> None:
        stop = asyncio.Event()

        async def on_xid(gpu: int, code: int) -> None:
            seen.append((gpu, code))
            if code == 48:
                stop.set()

        with open(os.path.join(nvml, "xids"), "w") as f:
            f.write(events)
        await asyncio.wait_for(xid.watch("gpu", (0, 1, 2, 3), on_xid, stop), 10)

    asyncio.run(run())
    return seen


def test_critical_xids_reach_the_handler_and_a_jobs_own_faults_do_not(nvml: str) -> None:
    assert watched(nvml, "1 79\n2 13\n0 31\n9 79\n3 48\n") == [(1, 79), (3, 48)]  # 13, 31: a job's; 9: not ours


def test_a_gpu_that_cannot_register_is_said_and_nvml_failing_is_tried_again(
        nvml: str, caplog: pytest.LogCaptureFixture) -> None:
    """GPU 2 is not NVML's (its handle fails): the others are read. NVML then fails (GPU_IS_LOST):
    said, and the reading starts again a second later (the stand-in keeps what it has not yet
    reported; the real NVML loses what comes meanwhile)."""
    with open(os.path.join(nvml, "gpus"), "w") as f:
        f.write("0 1 3\n")
    with caplog.at_level(logging.INFO, logger="mselastic.agent.devices.xid"):
        assert watched(nvml, "1 79\nlost\n3 48\n") == [(1, 79), (3, 48)]
    assert "NVML's Xid events read for GPUs 0,1,3" in caplog.text and \
        "GPU 2: its Xid events cannot be read: NVML error 1" in caplog.text, caplog.text
    assert "NVML's Xid events are not read (NVMLError: NVML error 15); trying again in 1s" in caplog.text, caplog.text


def test_nothing_is_read_on_a_node_without_nvml_or_without_gpus(nvml: str, caplog: pytest.LogCaptureFixture) -> None:
    os.remove(os.path.join(nvml, "gpus"))  # (nvmlInit fails: no driver)

    async def never(gpu: int, code: int) -> None:
        raise AssertionError("no event expected")

    async def run() -> None:
        await asyncio.wait_for(xid.watch("gpu", (0, 1), never, asyncio.Event()), 5)
        await asyncio.wait_for(xid.watch("ascend", (0, 1), never, asyncio.Event()), 1)

    with caplog.at_level(logging.INFO, logger="mselastic.agent.devices.xid"):
        asyncio.run(run())
    assert "NVML's Xid events are not read here: NVML error 12 (no NVIDIA driver)" in caplog.text, caplog.text


def test_the_reading_thread_ends_once_asked_to(nvml: str, caplog: pytest.LogCaptureFixture) -> None:
    async def never(gpu: int, code: int) -> None:
        raise AssertionError("no event expected")

    def reading() -> bool:
        return any(t.name == "nvml-xid" for t in threading.enumerate())

    async def run() -> bool:
        stop = asyncio.Event()
        task = asyncio.create_task(xid.watch("gpu", (0, 1), never, stop))
        while "NVML's Xid events read" not in caplog.text:
            await asyncio.sleep(0.05)
        assert reading()
        stop.set()
        await asyncio.wait_for(task, 5)
        for _ in range(100):  # (5 s: a wait for events is half a second)
            if not reading():
                return True
            await asyncio.sleep(0.05)
        return False

    with caplog.at_level(logging.INFO, logger="mselastic.agent.devices.xid"):
        assert asyncio.run(asyncio.wait_for(run(), 10)), "the thread did not end"
    assert "NVML's Xid events read for GPUs 0,1" in caplog.text, caplog.text
