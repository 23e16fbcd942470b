"""What the agent reads of this node to look at a generation, and nothing else: the TCP sockets'
states, msrun's children, msrun's log, and the wake-ups when a process of the generation ends.
What a look means is decided by :func:`mselastic.agent.generation.verdict.judge`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
from typing import Any, Callable, Iterable

import psutil

from mselastic.agent.containment import procs
from mselastic.agent.generation import learned, verdict
from mselastic.agent.standbys.forkserver import Proc
from mselastic.agent.generation.ranks import RankState

log = logging.getLogger(__name__)


def tcp_states(port: int) -> list[str] | None:
    """The states of this network namespace's TCP sockets whose local port is ``port``, from the
    kernel's tables (``/proc/net/tcp``, ``tcp6``; 0A: listening, 01: established); None when
    neither table could be read. Not psutil's net_connections, which also maps every socket to its
    process by reading every process's file descriptors (which the hardened unit may not)."""
    suffix = f":{port:04X}"
    states: list[str] = []
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                states += [fields[3] for line in f if len(fields := line.split()) > 3 and fields[1].endswith(suffix)]
            read = True
        except OSError:
            continue
    return states if read else None


def listens(port: int) -> bool:
    """Whether a TCP socket of this network namespace listens on ``port``."""
    return "0A" in (tcp_states(port) or [])


def connected(port: int) -> bool:
    """Whether anything is still connected to what listens on ``port`` here (an established TCP
    connection: a peer that exited has closed its end). Unknown (the tables unreadable) counts as
    connected: the generation then ends when msrun does."""
    states = tcp_states(port)
    return states is None or "01" in states


#: msrun's line when one of its workers exits with an error (``process_entity/_api.py``).
MSRUN_WORKER_DIED = re.compile(rb"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


def msrun_exits(log_file: Any) -> dict[int, int]:
    """pid -> exit code of the workers msrun's log says exited with an error (it reaps its workers
    once a second, often before this agent reads their status), for pids no longer running.
    Read through the file root opened for msrun (:func:`mselastic.agent.generation.launch.open_own`), never
    by its path: the folder is the worker user's, who could put a FIFO (a read that blocks the
    event loop), a link to /dev/zero or a text of their own there. Its last 64 KiB: msrun writes
    that line last."""
    try:
        fd = os.open(f"/proc/self/fd/{log_file.fileno()}", os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError):
        return {}
    try:
        size = os.fstat(fd).st_size
        tail = os.pread(fd, 1 << 16, max(0, size - (1 << 16)))
    except OSError:
        return {}
    finally:
        os.close(fd)
    return {int(m.group(1)): int(m.group(2)) for m in MSRUN_WORKER_DIED.finditer(tail)
            if not os.path.exists(f"/proc/{int(m.group(1))}")}


def discover(msrun_pid: int, ranks: dict[int, RankState], seen: set[int], script: str) -> None:
    """Learn each local rank's pid from msrun's direct children.

    A child is classified only once it has exec'd the training script: between
    fork and exec its environment is still msrun's own (no ``MS_ROLE``), so it is
    looked at again on the next poll. Descendants of the workers (data loaders)
    carry the same variables and are never taken for a rank. ``seen``: the children
    classified already.
    """
    if all(rs.pid for rs in ranks.values()):
        return  # (listing msrun's children reads every process's /proc/<pid>/stat: most of a poll)
    try:
        children = psutil.Process(msrun_pid).children()
    except psutil.NoSuchProcess:
        return
    for p in children:
        if p.pid in seen:
            continue
        d = procs.describe(p)
        if d is None or not d.role:
            continue
        try:
            is_script = script in p.cmdline()
        except psutil.NoSuchProcess:
            continue
        seen.add(p.pid)
        if d.role == "MS_WORKER" and is_script and d.rank in ranks and not ranks[d.rank].pid:
            ranks[d.rank].pid, ranks[d.rank].create_time = d.pid, d.create_time


class ExitWatch:
    """Wakes a generation's watch at once when one of its processes ends, instead of at its next
    look (up to ``poll_interval_s`` later); the look still decides what happened. The processes
    elasticd has a handle on (msrun, warm ranks and scheduler): when their exit code is known
    (asyncio's for msrun, the fork server's word for a standby), so that the look finds it.
    msrun's ranks, whose code their parent reaps: a pidfd, readable once the rank has exited (a
    zombie still shows its status). Each once, as its pid becomes known."""

    def __init__(self, ctx: dict[str, Any]) -> None:
        self.wake = asyncio.Event()
        #: msrun's ranks by pid -> pidfd (-1: none could be opened); handles by pid -> their wait().
        self.fds: dict[int, int] = {}
        self._waits: dict[int, asyncio.Future[int]] = {}
        self._ctx = ctx

    def watch(self, handles: Iterable[Any], ranks: Iterable[RankState]) -> None:
        """Watch ``handles`` (asyncio processes) and ``ranks`` (msrun's, by pidfd) not watched yet."""
        for proc in handles:
            if proc is not None and proc.pid not in self._waits:
                waiting = asyncio.ensure_future(proc.wait())
                waiting.add_done_callback(lambda _: self.wake.set())
                self._waits[proc.pid] = waiting
        loop = asyncio.get_running_loop()
        for rs in ranks:
            if not rs.pid or rs.pid in self.fds:
                continue
            try:
                fd = os.pidfd_open(rs.pid)
            except OSError as e:
                self.fds[rs.pid] = -1
                if e.errno != errno.ESRCH:  # (gone already: the look sees it)
                    log.warning("no pidfd for rank %d (pid %d): %s; its exit is seen at the next look",
                                rs.rank, rs.pid, e, extra={**self._ctx, "rank": rs.rank})
                continue
            if not procs.alive(rs.pid, rs.create_time):  # (gone, or another process's pid now: the look sees it)
                os.close(fd)
                self.fds[rs.pid] = -1
                continue
            self.fds[rs.pid] = fd
            loop.add_reader(fd, self._exited, fd)

    def _exited(self, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)  # (readable for good: once is enough)
        self.wake.set()

    def close(self) -> None:
        for fd in self.fds.values():
            if fd >= 0:
                asyncio.get_running_loop().remove_reader(fd)
                os.close(fd)
        for waiting in self._waits.values():
            waiting.cancel()
        self.fds, self._waits = {}, {}


def learn_pid(msrun_pid: int, rs: RankState, pid: int, seen: set[int]) -> None:
    """``rs``'s pid from its own heartbeat (the kernel names the sender) when it is one of msrun's
    own children: :func:`discover` may not have classified it yet, and a rank whose pid is unknown
    could not be seen to die."""
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(pid)
        d = procs.describe(p) if p.ppid() == msrun_pid else None
        if d is not None and d.role == "MS_WORKER" and d.rank == rs.rank:  # (as discover checks)
            rs.pid, rs.create_time = pid, d.create_time
            seen.add(pid)


class IdleWatch:
    """Whether a generation does nothing while every rank is silent past its idle limit (see
    mselastic.agent.generation.learned): its cgroup's work (``Group.work``: CPU time, waits for a
    CPU and on I/O, of every process and thread of it) read when the silence passes the limits
    and again every ``BUSY_WINDOW_S``; idle when it grew by less than ``BUSY_SHARE`` of a core."""

    def __init__(self) -> None:
        self._at: tuple[float, float] | None = None
        self._idle: bool | None = None

    def look(self, now: float, silent: bool, work: Callable[[], float | None]) -> bool | None:
        """``silent``: every rank is silent past its idle limit now. None: not known (yet)."""
        done = work() if silent else None
        if done is None:
            self._at = self._idle = None
            return None
        if self._at is None:
            self._at = (now, done)
        elif now - self._at[0] >= learned.BUSY_WINDOW_S:
            self._idle = not learned.busy(done - self._at[1], now - self._at[0])
            self._at = (now, done)
        return self._idle


def look(ranks: dict[int, RankState], now: float, started: float, log_dir: str, scheduler: Proc | None,
         cold: bool, msrun_exits: Callable[[], dict[int, int]], drain: Callable[[], None],
         whole: bool = False) -> verdict.Look:
    """Look at the ranks once, at ``now`` (monotonic): which are dead (a rank's last beat,
    finished, a planned exit or fatal, comes just before it exits, and its exit wakes the watch
    at once: the queued beats are read (``drain``) and the ranks looked at again), which msrun
    reaped (``cold``), how they exited as far as known (``msrun_exits``: msrun's log, for those it
    reaped first), which are stopped (state T) and since when; the warm ``scheduler``'s exit."""
    def dead() -> set[int]:
        return {rs.rank for rs in ranks.values()
                if not rs.finished and rs.exit_step < 0 and rs.pid and not procs.alive(rs.pid, rs.create_time)}

    gone = dead()
    if gone:
        drain()
        gone = dead()
    scheduler_exit = scheduler.returncode if scheduler is not None else None
    if scheduler_exit is not None:
        drain()  # (a rank's finished beat may be queued)
    saw = msrun_exits() if any(ranks[r].exit_code is None for r in gone) else {}
    stops = {}
    for rs in ranks.values():
        stops[rs.rank] = procs.stopped(rs.pid, rs.create_time) if rs.pid and rs.rank not in gone else ""
        rs.stopped_since = (rs.stopped_since or now) if stops[rs.rank] else 0.0
    return verdict.Look(now=now, started=started, scheduler_exit=scheduler_exit, whole=whole,
                        scheduler_pid=scheduler.pid if scheduler is not None else 0, log_dir=log_dir,
                        ranks={rs.rank: verdict.RankLook(
                            rank=rs.rank, pid=rs.pid, dead=rs.rank in gone,
                            reaped=rs.rank in gone and cold and procs.gone(rs.pid),
                            exit_code=rs.exit_code if rs.exit_code is not None else saw.get(rs.pid),
                            last_beat=rs.last_beat, finished=rs.finished, exit_step=rs.exit_step, fatal=rs.fatal,
                            stopped_since=rs.stopped_since, phase=rs.phase, phase_at=dict(rs.phase_at),
                            section=rs.section, traced=stops[rs.rank] == "t")
                            for rs in ranks.values()})
