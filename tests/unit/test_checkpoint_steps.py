"""The jobs table's checkpointed steps (mselastic.daemon.control.CheckpointSteps): a poll never
waits long for storage that hangs, and a hung read is not started again while its thread is stuck.
The storage is a stand-in here (a read that blocks until released); a real hung mount is
tests/integration/test_containment.py's."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mselastic.daemon import control


def test_a_hung_read_costs_a_poll_its_wait_once_and_is_not_started_again_while_stuck(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    release = threading.Event()
    calls = []

    def hung(checkpoint_dir: str, job: str) -> int | None:
        calls.append(job)
        release.wait(10)
        return 42

    monkeypatch.setattr(control, "checkpointed_step", hung)
    monkeypatch.setattr(control, "READ_S", 0.2)

    async def run() -> None:
        steps = control.CheckpointSteps()
        steps.KEEP_S = 0.05
        t0 = time.monotonic()
        assert await steps.get("a", "/ckpt") is None
        assert time.monotonic() - t0 < steps.WAIT_S + 0.2
        await asyncio.sleep(0.4)  # (the read gave up; its thread is still stuck)
        for _ in range(3):
            t0 = time.monotonic()
            assert await steps.get("a", "/ckpt") is None
            assert time.monotonic() - t0 < 0.1  # (its answer kept: not waited for again)
        assert calls == ["a"]  # (none started beside the stuck one)
        release.set()
        await asyncio.sleep(0.2)
        assert await steps.get("a", "/ckpt") == 42 and calls == ["a", "a"]

    asyncio.run(run())


def test_a_read_that_raises_shows_no_step(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def nested(checkpoint_dir: str, job: str) -> int | None:
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")

    monkeypatch.setattr(control, "checkpointed_step", nested)
    assert asyncio.run(control.CheckpointSteps().get("a", "/ckpt")) is None


@pytest.mark.parametrize("nesting", [100000])
def test_a_deeply_nested_latest_json_is_no_step(tmp_path, nesting: int) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "latest.json").write_text("[" * nesting + "]" * nesting)
    assert asyncio.run(control.CheckpointSteps().get("a", str(tmp_path))) is None
