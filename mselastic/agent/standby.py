"""Standby workers: a relaunch hands a generation to processes that have already imported MindSpore.

A cold relaunch starts msrun, which starts a scheduler and one worker per local rank, each a new
Python importing MindSpore: about 5 s of a 7 s relaunch on two cores, before MindSpore does
anything. The agent keeps, per job running here, one standby per local rank and one for a
scheduler (:mod:`mselastic.trainer.standby` is the process side): started as the worker user with
the job's environment once the job trains here, idle until a relaunch, then handed the
generation (see ``Generation`` in the supervisor) and replaced after use.

A pool belongs to one *launch key*: everything a standby was started with that a generation
could change (the script, its arguments and folder, the worker user, the job-level environment).
A generation whose key differs (the job was submitted again with another spec) starts cold and
the pool is replaced. Standbys carry a marker of their own (``standby.<job>.<node>.<id>``) until
handed a generation, never a generation's: they cannot beat for one or be torn down with one
before they are part of it. They die with elasticd (parent-death signal), and the pool of a job
that no longer runs here is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import time
import uuid
from typing import Any, Awaitable, Callable

from mselastic.core.contract import STANDBY_READY

log = logging.getLogger(__name__)

#: How long a standby may take to import MindSpore and say it is ready (it shares the CPU with
#: the ranks that train meanwhile).
READY_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Standby:
    proc: asyncio.subprocess.Process
    marker: str
    #: Its standard input and output: one end of a socket pair (a pipe could be opened through
    #: /proc/<pid>/fd by any process of the worker user, another job's script too, and written to).
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    #: Monotonic time it said it was ready (0: not yet).
    ready_at: float = 0.0
    #: Set with ready_at (a generation that took it while it was importing waits on it).
    ready_event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: Taken by a generation: its pool no longer kills it, nor takes its end for a broken pool.
    taken: bool = False
    _drain: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, spawn: "Spawner", marker: str) -> "Standby":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await spawn(marker, theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except BaseException:
            ours.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise
        return cls(proc, marker, reader, writer)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def await_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Read its output until it says it is ready (True), exits or times out (False); then keep
        reading, so that whatever it prints never blocks it."""
        async def ready() -> bool:
            while line := await self.reader.readline():
                if line.decode(errors="replace").startswith(STANDBY_READY):
                    return True
            return False

        try:
            ok = await asyncio.wait_for(ready(), timeout_s)
        except asyncio.TimeoutError:
            ok = False
        if ok:
            self.ready_at = time.monotonic()
            self.ready_event.set()
            self._drain = asyncio.create_task(_drain(self.reader), name=f"standby-out-{self.pid}")
        return ok

    async def until_ready(self, timeout_s: float) -> None:
        """For one taken while it was still importing: return once it is ready (its pool reads its
        output and says so); raise RuntimeError when it exits first or is not ready in time."""
        if not self.ready_at:
            waits = [asyncio.create_task(self.ready_event.wait()), asyncio.create_task(self.proc.wait())]
            try:
                await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
        if not self.alive:
            raise RuntimeError(f"standby pid {self.pid} exited with code {self.proc.returncode} before it was ready")
        if not self.ready_at:
            raise RuntimeError(f"standby pid {self.pid} was not ready within {timeout_s:.0f}s")

    async def hand_over(self, env: dict[str, str], argv: list[str], cwd: str, log_path: str,
                        timeout_s: float = 5.0) -> None:
        """Give it its generation (see :mod:`mselastic.trainer.standby`). Raises OSError when it is
        gone (a broken connection), TimeoutError when it does not take it in time."""
        if not self.alive:
            raise OSError(f"standby pid {self.pid} exited with code {self.proc.returncode}")
        msg = json.dumps({"env": env, "argv": argv, "cwd": cwd, "log": log_path}) + "\n"
        self.writer.write(msg.encode())
        await asyncio.wait_for(self.writer.drain(), timeout_s)
        self.writer.write_eof()

    async def kill(self) -> None:
        """SIGKILL its process group (it is a session leader: whatever it started is in it) and reap
        it. Not once it has been reaped: its pid may be another process's by then."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()
        self.writer.close()
        if self._drain is not None:
            self._drain.cancel()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(1 << 16):
        pass


#: Starts one standby process: (its marker, the file descriptor for its standard input, output and
#: error) -> the process.
Spawner = Callable[[str, int], Awaitable[asyncio.subprocess.Process]]


class StandbyPool:
    """The standbys this node keeps for one job and launch key."""

    def __init__(self, job: str, node_id: str, key: str, spawn: Spawner) -> None:
        self.job, self.node_id, self.key = job, node_id, key
        self._spawn = spawn
        self.standbys: list[Standby] = []
        self._filling: asyncio.Task[None] | None = None
        self._closed = False
        #: Why filling stopped for good ("" while it may go on): a standby that cannot start
        #: (the worker user cannot import MindSpore, ...) is not started again and again.
        self.broken = ""
        self._ctx = dict(job=job, node=node_id)

    def ready(self) -> list[Standby]:
        return [s for s in self.standbys if s.ready_at and s.alive]

    def fill(self, size: int) -> None:
        """Start standbys until ``size`` of them are alive (in the background, all at once: they are
        ready sooner than one after the other, and the ranks share the CPU with them either way)."""
        if self._closed or self.broken or (self._filling is not None and not self._filling.done()):
            return
        self._filling = asyncio.create_task(self._fill(size), name=f"standbys-{self.job}")

    async def _fill(self, size: int) -> None:
        dead = [s for s in self.standbys if not s.alive]
        self.standbys = [s for s in self.standbys if s.alive]
        await asyncio.gather(*(s.kill() for s in dead))  # (reaped already: no signal is sent)
        missing = size - len(self.standbys)
        await asyncio.gather(*(self._start_one(size) for _ in range(missing)))

    async def _start_one(self, size: int) -> None:
        marker = f"standby.{self.job}.{self.node_id}.{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        try:
            standby = await Standby.start(self._spawn, marker)
        except (OSError, RuntimeError) as e:
            self._break(f"a standby could not be started: {e}")
            return
        self.standbys.append(standby)
        if await standby.await_ready():
            log.info("standby pid %d ready in %.1fs (%s)", standby.pid, time.monotonic() - started,
                     f"{len(self.ready())} of {size}" if standby in self.standbys else "taken by a relaunch already",
                     extra=self._ctx)
            return
        if standby.taken:  # a generation's now: it reports what became of it (and was maybe stopped)
            return
        try:  # its output ended: it exited (or is exiting); else it timed out
            code: int | None = await asyncio.wait_for(standby.proc.wait(), 2.0)
        except asyncio.TimeoutError:
            code = None
        if standby in self.standbys:
            self.standbys.remove(standby)
        await standby.kill()
        if not self._closed:
            self._break(f"standby pid {standby.pid} exited with code {code} before it was ready" if code is not None
                        else f"standby pid {standby.pid} was not ready within {READY_TIMEOUT_S:.0f}s")

    def _break(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            log.warning("%s; relaunches of this job start cold here", why, extra=self._ctx)

    def take(self, count: int) -> list[Standby]:
        """``count`` live standbys, removed from the pool, the ready ones first; [] when it has
        fewer. One still importing is taken too (a relaunch soon after the last, before the
        replacements are ready): the handover waits for it, and it is further on than msrun's
        processes would be, which import MindSpore one after the other (msrun itself, then each
        rank). (The dead are left for the next fill to reap and replace.)"""
        alive = sorted((s for s in self.standbys if s.alive and (s.ready_at or not self.broken)),
                       key=lambda s: not s.ready_at)  # (a broken pool's importing ones may not get there)
        if len(alive) < count:
            return []
        taken = alive[:count]
        for standby in taken:
            standby.taken = True
        self.standbys = [s for s in self.standbys if s not in taken]
        return taken

    async def close(self) -> None:
        """Stop every standby (and any filling)."""
        self._closed = True
        if self._filling is not None:
            self._filling.cancel()
            await asyncio.gather(self._filling, return_exceptions=True)
        standbys, self.standbys = self.standbys, []
        await asyncio.gather(*(s.kill() for s in standbys))

    def describe(self) -> list[dict[str, Any]]:
        return [dict(pid=s.pid, ready=bool(s.ready_at) and s.alive) for s in self.standbys]
