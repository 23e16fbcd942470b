"""elasticd's shutdown steps are bounded (daemon.main.Shutdown, #49), and the embedded etcd's port is
checked before it starts (store.embedded.port_holder): pure asyncio and sockets, no process."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from typing import Any

from mselastic.core.waits import within
from mselastic.daemon.main import Shutdown, run_bounded
from mselastic.store.embedded import free_port, port_holder
from tests.harness import REPO


def test_a_step_that_never_ends_or_ignores_its_cancellation_is_left_and_named() -> None:
    async def go() -> tuple[list[str], float]:
        shutdown = Shutdown()

        async def deaf() -> None:  # (a cancelled gather waiting on a shielded kill behaves so)
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    continue

        async def fails() -> None:
            raise RuntimeError("boom")

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await shutdown.step("a step that never ends", asyncio.sleep(3600), 0.1)
        await shutdown.step("a deaf step", deaf(), 0.1)
        await shutdown.step("a step that fails", fails(), 0.1)
        await shutdown.step("a quick step", asyncio.sleep(0), 0.1)
        return shutdown.overran, loop.time() - t0

    said: list[tuple[list[str], float]] = []

    async def record() -> None:
        said.append(await go())

    t0 = time.monotonic()
    run_bounded(record(), end_s=0.2)  # (asyncio.run would wait for the deaf step for ever)
    (overran, took), = said
    assert overran == ["a step that never ends", "a deaf step", "a step that fails (failed)"], overran
    assert took < 1.0 and time.monotonic() - t0 < 2.0, took


def test_the_port_holder_is_named_and_a_lingering_port_is_free() -> None:
    port = free_port()
    assert port_holder("127.0.0.1", port) == ""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        assert f"(pid {os.getpid()})" in port_holder("127.0.0.1", port)
        # A connection through it, closed by the client: the port lingers in TIME_WAIT once the
        # listener goes, which etcd (SO_REUSEADDR) binds over, and so does the check.
        c = socket.create_connection(("127.0.0.1", port))
        conn, _ = s.accept()
        conn.close()
        c.close()
    assert port_holder("127.0.0.1", port) == ""


def test_an_overrun_step_says_what_it_waited_on(caplog) -> None:  # type: ignore[no-untyped-def]
    """#49: a step past its bound names the tasks still waiting, and where (the last time one
    overran in the suite, the log said only which step)."""
    async def go() -> None:
        async def held_by_a_lock(lock: asyncio.Lock) -> None:
            async with lock:
                pass

        lock = asyncio.Lock()
        await lock.acquire()
        task = asyncio.create_task(held_by_a_lock(lock), name="the-agent")
        await Shutdown().step("the end of the agent", asyncio.gather(task), 0.1)
        lock.release()

    with caplog.at_level("ERROR"):
        asyncio.run(go())
    line = next(r.getMessage() for r in caplog.records if "did not finish" in r.getMessage())
    assert "waiting were: " in line and "the-agent: acquire (locks.py:" in line and \
        "< held_by_a_lock (test_shutdown.py:" in line, line  # (the innermost frame first)


async def _cancelled_as_it_completes(wait: Any) -> str:
    """A task waiting (through ``wait``) on a future that completes in the same turn of the loop
    as the task is cancelled: what the task sees."""
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(wait(fut, 10))
    await asyncio.sleep(0)  # (the task now waits on fut)
    fut.set_result(1)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "result"


def test_a_cancellation_that_comes_as_the_awaited_thing_completes_is_not_lost() -> None:
    """waits.within keeps it (a loop told to stop stops); asyncio.wait_for of Python 3.11 loses it
    (cpython gh-86296), which held an elasticd's shutdown 75 s on its lease's keep-alive loop."""
    assert asyncio.run(_cancelled_as_it_completes(within)) == "cancelled"
    if sys.version_info < (3, 12):
        assert asyncio.run(_cancelled_as_it_completes(asyncio.wait_for)) == "result"


def test_the_daemon_never_waits_through_asyncio_wait_for() -> None:
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, "mselastic")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    found += [f"{name}:{i}" for i, line in enumerate(f, 1) if "asyncio.wait_for(" in line]
    assert not found, f"use mselastic.core.waits.within (asyncio.wait_for loses cancellations): {found}"
