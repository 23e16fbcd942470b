"""Standby workers: a relaunch hands a generation to processes that have already imported MindSpore.

A cold relaunch starts msrun, which starts a scheduler and one worker per local rank, each a new
Python importing MindSpore: about 5 s of a 7 s relaunch on two cores, before MindSpore does
anything. The agent keeps, per job running here, one standby per local rank and one for a
scheduler (:mod:`mselastic.trainer.standby` is the process side), idle until a relaunch, then
handed the generation (see :class:`mselastic.agent.generation.launch.Launch`) and replaced after use
(the pools: :mod:`mselastic.agent.standbys.pools`).

The standbys are forked, not started: once the job trains here the pool starts one *fork server*
(as the worker user with the job's environment, in the script's folder, dying with elasticd),
which imports MindSpore once and forks a standby per request in milliseconds. Replacing the
standbys a relaunch used therefore costs no import on the cores the new generation trains on
(it cost about 3 CPU-seconds per standby: docs/journal/2026-12.md, "Forked standbys"). A forked standby dies
with its server, so the server is stopped only once no standby it forked runs as a rank.

A pool belongs to one *launch key*: everything a standby was started with that a generation
could change (the script, its arguments and folder, the worker user, the job-level environment).
A generation whose key differs (the job was submitted again with another spec) starts cold and
the pool is replaced. Standbys carry a marker of their own (``standby.<job>.<node>.<id>``) until
handed a generation, never a generation's: they cannot beat for one or be torn down with one
before they are part of it. The pool of a job that no longer runs here is stopped.
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
import stat
import time
import uuid
from typing import Any, Awaitable, Callable, Protocol, TypeVar

import psutil

from mselastic.agent.containment import procs
from mselastic.agent.containment.cgroups import exited
from mselastic.agent.containment.jobfiles import bounded, read_tail
from mselastic.core.contract import STANDBY_FORKS, STANDBY_READY
from mselastic.core.waits import within

log = logging.getLogger(__name__)

#: How long a standby may take to import MindSpore and say it is ready (it shares the CPU with
#: the ranks that train meanwhile).
READY_TIMEOUT_S = 600.0


class Proc(Protocol):
    """What the agent needs of a process it started: asyncio's, or a standby a fork server forked."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


P = TypeVar("P", bound=Proc)


async def _spawn_on_socket(spawn: Callable[[str, int], Awaitable[P]], marker: str) -> tuple[P, socket.socket]:
    """Start a process with ``spawn``, one end of a new socket pair its standard input, output and
    error; returns it and the other end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = await spawn(marker, theirs.fileno())
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


@dataclasses.dataclass
class Standby:
    proc: Proc
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
    async def start(cls, spawn: Callable[[str, int], Awaitable[Proc]], marker: str) -> "Standby":
        proc, ours = await _spawn_on_socket(spawn, marker)
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

    def gone(self) -> bool:
        """Not alive, or (forked) exited as the kernel says this instant."""
        return not self.alive or (isinstance(self.proc, Forked) and self.proc.ended_now())

    async def await_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Read its output until it says it is ready (True), exits or times out (False); then keep
        reading, so that whatever it prints never blocks it."""
        async def ready() -> bool:
            while line := await self.reader.readline():
                if line.decode(errors="replace").startswith(STANDBY_READY):
                    return True
            return False

        try:
            ok = await within(ready(), timeout_s)
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
            await _ready_or_ended(self.ready_event, self.proc, timeout_s)
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
        await within(self.writer.drain(), timeout_s)
        self.writer.write_eof()

    async def kill(self) -> None:
        """SIGKILL it (through its pidfd when forked: never a pid another process took over) and
        wait for its end. Only the process: one never handed a generation started nothing, and
        one that was is its generation's, whose teardown stops its process group."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(asyncio.TimeoutError):  # (forked: its server reaps it and says so)
            await within(self.proc.wait(), 5)
        self.writer.close()
        if self._drain is not None:
            self._drain.cancel()


async def _ready_or_ended(ready: asyncio.Event, proc: Proc, timeout_s: float) -> None:
    """Wait until ``ready`` is set, ``proc`` has ended or ``timeout_s`` has passed."""
    waits = [asyncio.create_task(ready.wait()), asyncio.create_task(proc.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(1 << 16):
        pass


#: Starts one standby process: (its marker, the file descriptor for its standard input, output and
#: error) -> the process.
Spawner = Callable[[str, int], Awaitable[asyncio.subprocess.Process]]
#: What to do once a fork server has ended and been reaped (stop what is left in its cgroup).
Release = Callable[[], Awaitable[None]]



#: How long a forked standby's end waits for its exit code from a fork server that still runs (it
#: reaps at once, at nice 19): then it counts as killed. A server that has ended never says: at once.
EXIT_CODE_BACKSTOP_S = 30.0

#: A fork server's answer to one request (it answers at once: it only forks).
FORK_ANSWER_S = 10.0

#: Longest line a fork server may send (its answers are short; MindSpore's log lines too).
MAX_LINE = 1 << 20


class Forked:
    """A standby forked by a fork server, which is its parent and reaps it. Its end is the kernel's
    word (a pidfd: readable once it has exited, and the only handle signals go through, so a pid
    taken over by another process is never signalled); its exit code is the server's."""

    def __init__(self, pid: int, pidfd: int, server_alive: Callable[[], bool],
                 server: "ForkServer | None" = None) -> None:
        self.pid, self._pidfd, self._server_alive = pid, pidfd, server_alive
        #: The fork server that forked it (its parent).
        self.server = server
        self.returncode: int | None = None
        self._code: int | None = None
        self._ended = False
        self._exited = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(pidfd, self._on_end)

    @property
    def pidfd(self) -> int:
        """Its pidfd (open while ``returncode`` is None)."""
        return self._pidfd

    def ended_now(self) -> bool:
        """Whether it has exited, as the kernel says this instant (its pidfd readable), before the
        event loop has seen it (its server killed a moment ago: it dies with it)."""
        return self._ended or self.returncode is not None or exited(self._pidfd)

    def _on_end(self) -> None:
        self._loop.remove_reader(self._pidfd)
        self._ended = True
        if self._code is not None:
            self._finish(self._code)
        elif not self._server_alive():
            self._finish(-signal.SIGKILL)  # (its server is gone: its death signal)
        else:
            self._loop.call_later(EXIT_CODE_BACKSTOP_S, self._finish, -signal.SIGKILL)

    def told(self, code: int) -> None:
        """Its server says it exited with ``code`` (believed once the kernel says it has ended)."""
        self._code = code
        if self._ended:
            self._finish(code)

    def server_gone(self) -> None:
        """Its server ended: if it has ended too, no code will come."""
        if self._ended:
            self._finish(-signal.SIGKILL if self._code is None else self._code)

    def _finish(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()
            os.close(self._pidfd)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if not self._ended:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def release(self) -> None:
        """Stop watching it, leaving it running (elasticd restarts: its generation is left to its
        shim, and it to the next elasticd, which adopts it as an :class:`Orphan`)."""
        if self.returncode is None and not self._ended:
            self._loop.remove_reader(self._pidfd)
            self._ended = True
            os.close(self._pidfd)
            # (Never reported, nor its wait woken: its generation is no longer this elasticd's, and a
            # wait that woke would stop its server: close_after.)
            self.returncode = -1

    def discard(self) -> None:
        """Forget it without waiting for its end (its server is being stopped, and it with it)."""
        if self.returncode is None:
            if not self._ended:
                self._loop.remove_reader(self._pidfd)
                self._ended = True
            self._finish(-signal.SIGKILL)


class ForkServer:
    """One process per job and node that imports MindSpore once and forks the standbys
    (``mselastic.trainer.standby``): a standby costs milliseconds instead of an import (about
    3 CPU-seconds, on the cores the ranks train on). It is a standby process itself (started the
    same way, with a marker of its own) that never takes a generation; the standbys it forks die
    with it, and it with elasticd. It runs as the worker user, and a job's code may run in it (it
    imports from the script's folder): nothing it says is believed without the kernel's word. A
    pid it names must be its own child, of its own user, opened as a pidfd at once; an answer
    names the request it answers; a line it sends that does not parse is dropped."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket, release: Release | None = None,
                 marker: str = "") -> None:
        self.proc, self._sock, self._release, self.marker = proc, sock, release, marker
        #: Left to run on without elasticd (:meth:`leave`): never stopped by this elasticd.
        self.left = False
        try:  # (signals go through it: once reaped, its pid may be another process's)
            self._pidfd: int | None = os.pidfd_open(proc.pid)
        except OSError:
            self._pidfd = None  # (it is gone already)
        self.children: dict[int, Forked] = {}
        self.ready_event = asyncio.Event()
        self._asked: dict[str, asyncio.Future[Forked | str]] = {}
        self._lock = asyncio.Lock()
        self._failed = False
        self._reader = asyncio.create_task(self._read(), name=f"fork-server-{proc.pid}")
        # Its end, by the kernel's word (its output may stay open: a process the job's code started
        # in it may hold a copy): closed then, what it left in its cgroup released at once.
        self._closing: asyncio.Task[None] | None = None
        if self._pidfd is not None:
            asyncio.get_running_loop().add_reader(self._pidfd, self._ended)

    def _ended(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
        if self._closing is None:
            self._closing = asyncio.create_task(self.close(), name=f"fork-server-ended-{self.pid}")

    @classmethod
    async def start(cls, spawn: Spawner, marker: str, release: Release | None = None) -> "ForkServer":
        proc, ours = await _spawn_on_socket(spawn, marker)
        ours.setblocking(False)
        return cls(proc, ours, release, marker)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self._failed and self._running_now()

    def _running_now(self) -> bool:
        """Whether it still runs, by the kernel's word (its output may stay open after its end: a
        process the job's code started in it holds a copy)."""
        return not self._reader.done() and self._pidfd is not None and not exited(self._pidfd)

    def running(self) -> list[Forked]:
        """The standbys it forked that have not ended (taken or not)."""
        return [c for c in self.children.values() if c.returncode is None]

    async def _read(self) -> None:
        """Its output: the ready line, then its answers (anything else, MindSpore's log lines on its
        standard error, is dropped; so is an answer that does not parse, with a warning)."""
        loop = asyncio.get_running_loop()
        buf = b""
        try:
            while chunk := await loop.sock_recv(self._sock, 1 << 16):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > MAX_LINE:
                    log.warning("fork server pid %d: a line of over %d bytes dropped", self.pid, MAX_LINE)
                    buf = b""
                for raw in lines:
                    self._line(raw.decode(errors="replace"))
        except OSError as e:
            log.warning("fork server pid %d: %s", self.pid, e)
        finally:
            for child in self.children.values():
                child.server_gone()
            for waiting in self._asked.values():
                if not waiting.done():
                    waiting.set_result(f"fork server pid {self.pid} exited")

    def _line(self, line: str) -> None:
        if line.startswith(STANDBY_READY):
            self.ready_event.set()
        elif line.startswith(STANDBY_FORKS + " "):
            try:
                what = json.loads(line[len(STANDBY_FORKS) + 1:])
                if not isinstance(what, dict):
                    raise ValueError("not an object")
                self._answer(what)
            except Exception as e:  # (whatever it sent: its ranks must not pay for it)
                log.warning("fork server pid %d said %r: %s", self.pid, line[:200], e)

    def _answer(self, what: dict[str, Any]) -> None:
        if "exit" in what:
            child = self.children.get(int(what["exit"]))
            if child is not None:
                child.told(int(what["code"]))
            return
        waiting = self._asked.get(str(what.get("marker", "")))
        if waiting is None or waiting.done():
            raise ValueError("an answer to no request of ours")
        waiting.set_result(self._adopt(int(what["forked"])) if "forked" in what else str(what.get("error", what)))
        # ({"kept": n} answers a keep: any answer will do)

    def _adopt(self, pid: int) -> Forked | str:
        """The child it says it forked, once the kernel agrees: alive, its child, its user."""
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, OverflowError) as e:
            return f"forked pid {pid}, which cannot be opened: {e}"
        try:
            p, server = psutil.Process(pid), psutil.Process(self.pid)
            if p.ppid() != self.pid or p.uids().real != server.uids().real:
                raise ValueError("not a child of its own, of its own user")
            signal.pidfd_send_signal(pidfd, 0)  # (the pid still names the process the pidfd holds)
        except (psutil.Error, OSError, ValueError) as e:
            os.close(pidfd)
            return f"named pid {pid}: {e}"
        for gone in [c for c in self.children.values() if c.returncode is not None]:
            del self.children[gone.pid]
        child = self.children[pid] = Forked(pid, pidfd, self._running_now, self)
        return child

    async def await_ready(self, timeout_s: float) -> bool:
        await _ready_or_ended(self.ready_event, self.proc, timeout_s)
        return self.ready_event.is_set() and self.alive

    async def fork(self, marker: str, fd: int) -> Forked:
        """A new standby with ``marker``, ``fd`` its standard input, output and error (a Spawner).
        Raises RuntimeError when the server cannot; one that does not answer in time is not asked
        again (the pool replaces it)."""
        async with self._lock:
            if not self.alive:
                raise RuntimeError(f"fork server pid {self.pid} exited")
            waiting = self._asked[marker] = asyncio.get_running_loop().create_future()
            try:
                socket.send_fds(self._sock, [json.dumps({"fork": marker}).encode()], [fd])
                got = await within(asyncio.shield(waiting), FORK_ANSWER_S)
            except OSError as e:
                raise RuntimeError(f"fork server pid {self.pid}: {e}") from None
            except asyncio.TimeoutError:
                self._failed = True
                raise RuntimeError(f"fork server pid {self.pid} did not answer within {FORK_ANSWER_S:.0f}s") from None
            finally:
                del self._asked[marker]
        if isinstance(got, str):
            raise RuntimeError(f"fork server pid {self.pid}: {got}")
        return got

    def start_time(self) -> float:
        """Its start time, as psutil gives it (0.0: gone)."""
        try:
            return psutil.Process(self.pid).create_time()
        except psutil.Error:
            return 0.0

    async def leave(self) -> None:
        """elasticd restarts and leaves a generation whose ranks this server forked to its shim:
        the server runs on (it outlives elasticd, see ``mselastic.trainer.standby.serve``): elasticd
        stops watching it and closes its end of the socket (the server forks no more and exits once
        the ranks have ended, recording how), and asyncio is told not to kill it."""
        self.left = True
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close()
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self.proc.returncode is None:
            procs.disown(self.proc)
        for child in self.children.values():
            child.release()

    async def keep(self, pids: list[int]) -> None:
        """Tell it that ``pids`` (its children, ranks of a generation whose record a successor of
        elasticd adopts it by is written) run on once elasticd's end of its socket closes; it kills
        the others it forked then (see ``mselastic.trainer.standby.serve``). Raises RuntimeError when
        it does not answer."""
        marker = f"keep-{uuid.uuid4().hex[:8]}"
        async with self._lock:
            if not self.alive:
                raise RuntimeError(f"fork server pid {self.pid} exited")
            waiting = self._asked[marker] = asyncio.get_running_loop().create_future()
            try:
                await asyncio.get_running_loop().sock_sendall(self._sock, json.dumps({"keep": pids,
                                                                                      "marker": marker}).encode())
                await within(asyncio.shield(waiting), FORK_ANSWER_S)
            except (OSError, asyncio.TimeoutError) as e:
                raise RuntimeError(f"fork server pid {self.pid} did not take the ranks to keep: {e!r}") from None
            finally:
                del self._asked[marker]

    async def close(self) -> None:
        """End it (its standbys with it: their death signal) and reap it; not one left (:meth:`leave`)."""
        if self.left:
            return
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close()  # (after its reader: the loop no longer watches the descriptor)
        if self.proc.returncode is None:
            # Its process group too (a session leader: whatever else it started; the standbys also
            # die by their death signal). A group's id is not handed to a new process while any
            # member lives.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self._pidfd is not None:
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        await self.proc.wait()
        for child in list(self.children.values()):
            child.discard()
        release, self._release = self._release, None
        if release is not None:
            await release()

    async def close_after(self, children: list[Forked]) -> None:
        """Close it once ``children`` (standbys that are ranks now) have ended."""
        await asyncio.gather(*(c.wait() for c in children))
        await self.close()


#: How long an adopted rank's end waits for its code in its fork server's record while the server
#: runs (it reaps at once, at nice 19): then it counts as killed.
EXIT_RECORD_S = 5.0
#: The part of a fork server's record read for one code (its lines are short; it is the job's file).
EXIT_RECORD_BYTES = 1 << 16


def recorded_exit(path: str, pid: int, offset: int) -> int | None:
    """The last code ``path`` (a fork server's record of its children's ends, a file of the job's:
    never through a symlink, never blocking, a bounded read) gives ``pid`` after ``offset``."""
    code = None
    for line in read_tail(path, EXIT_RECORD_BYTES, since=offset).splitlines():
        with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
            what = json.loads(line)
            if int(what["exit"]) == pid:
                code = int(what["code"])
    return code


def record_size(path: str) -> int:
    """How much of a fork server's record there is now (0: none yet, or not a regular file)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


class Orphan:
    """A warm rank (or scheduler) an earlier elasticd handed its generation to, adopted by this
    one. Its parent is that elasticd's fork server, which outlives elasticd while it has children
    and records how each ends (``exits``: see ``mselastic.trainer.standby.serve``). Its end is the
    kernel's word (a pidfd, opened and pinned to its start time); its code, the kernel's while it
    is a zombie, else the server's record (read past what it held at the adoption: a pid the
    server forked earlier may be there too), else, the server gone or silent for
    :data:`EXIT_RECORD_S`, killed (-SIGKILL)."""

    def __init__(self, pid: int, start: float, exits: str, server: tuple[int, float]) -> None:
        self.pid, self.start, self._exits, self._server = pid, start, exits, server
        self.returncode: int | None = None
        self._exited = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._settling: asyncio.Task[None] | None = None
        self._offset = record_size(exits)  # (first: an end recorded from here on is this process's)
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = -1
        if self._pidfd >= 0 and procs.alive(pid, start):
            self._loop.add_reader(self._pidfd, self._on_end)
            return
        # It ended while no elasticd ran (a failure like any other, seen at the first look; or it
        # finished): its code is the kernel's while it is a zombie, else the server's record, read
        # whole (its line is the last for that pid: the server forks no more once elasticd is gone).
        code = procs.exit_status(pid, start)
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if code is not None:
            self.returncode = code
            self._exited.set()
        else:
            self._offset = 0
            self._settling = asyncio.create_task(self._settle(), name=f"orphan-exit-{pid}")

    @property
    def pidfd(self) -> int:
        return self._pidfd

    def ended_now(self) -> bool:
        return self.returncode is not None or self._pidfd < 0 or exited(self._pidfd)

    def _on_end(self) -> None:
        self._loop.remove_reader(self._pidfd)
        code = procs.exit_status(self.pid, self.start)  # (a zombie still: its server has not reaped it)
        if code is not None:
            self._finish(code)
        elif self._settling is None:
            self._settling = asyncio.create_task(self._settle(), name=f"orphan-exit-{self.pid}")

    async def _settle(self) -> None:
        deadline = time.monotonic() + EXIT_RECORD_S
        while self.returncode is None:
            try:
                code = await bounded(recorded_exit, self._exits, self.pid, self._offset)
            except OSError:
                code = None
            if code is not None:
                self._finish(code)
            elif time.monotonic() > deadline or not procs.alive(*self._server):
                self._finish(-signal.SIGKILL)
            else:
                await asyncio.sleep(0.05)

    def _finish(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()
            self._close()

    def _close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def release(self) -> None:
        """Stop watching it, leaving it running (elasticd restarts again)."""
        if self.returncode is None:
            if self._settling is not None:
                self._settling.cancel()
            elif self._pidfd >= 0:
                self._loop.remove_reader(self._pidfd)
            self.returncode = -1
            self._close()
