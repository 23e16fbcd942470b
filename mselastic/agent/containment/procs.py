"""Finding and killing every process of one generation on this node where there are no cgroups
(with them, the generation's cgroup says who is in it and ``cgroup.kill`` ends them: see
:mod:`mselastic.agent.containment.cgroups`). The rank-level reads below (``/proc/PID/stat``) serve both.

msrun puts each worker in its own session, its scheduler in msrun's group, and
does not forward SIGTERM: killing msrun's group alone orphans the workers. So a
generation is identified by a marker in the environment of every process it
starts (``MSELASTIC_RUN_ID``, inherited through msrun), and stopping it means:
SIGCONT (a stopped rank ignores SIGTERM), SIGTERM, a grace period, SIGKILL to
every process group that holds a marked process, then a check that no marked
process is left. Nothing is ever killed by name.

Reading another user's ``/proc/PID/environ`` takes CAP_SYS_PTRACE, which the unit does not
give elasticd (with it, a compromised daemon could write any process's memory, PID 1's
too). The kernel grants the read to a caller whose file-system uid and gid are the
process's own, so when the plain read is refused for a process of the worker user
(:func:`read_as`), root takes that user's fsuid/fsgid for that one read and takes its own
back at once (setfsuid is per thread: nothing else runs on the calling thread meanwhile but
what the interpreter may run between two bytecodes, which touches no file). A worker that
made itself non-dumpable cannot be read even so; its generation's process groups are still
killed whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import signal
import time
from typing import Callable, Iterator

import psutil

from mselastic.core.contract import ENV_RUN_ID
from mselastic.core.waits import within


@dataclasses.dataclass(frozen=True)
class Proc:
    pid: int
    create_time: float
    role: str  # "MS_WORKER", "MS_SCHED" or "" (msrun, tail, anything else)
    rank: int  # RANK_ID for workers, -1 otherwise


_libc = ctypes.CDLL(None, use_errno=True)
#: The users whose processes' environment root reads with their fsuid when refused (see above).
_READ_AS: list[range] = []


def read_as(uids: int | range) -> None:
    """Processes of ``uids`` (the worker user, the jobs' uids) may be read with their fsuid when a
    plain read is refused."""
    _READ_AS.append(range(uids, uids + 1) if isinstance(uids, int) else uids)


def _may_read_as(uid: int) -> bool:
    return uid != 0 and any(uid in r for r in _READ_AS)


def _environ(p: psutil.Process) -> dict[str, str] | None:
    try:
        return p.environ()
    except psutil.AccessDenied:
        if os.geteuid() != 0 or not _READ_AS:
            return None
        try:
            if not _may_read_as(p.uids().real):
                return None
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        return _environ_as_owner(p)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
        return None


def _environ_as_owner(p: psutil.Process) -> dict[str, str] | None:
    """``p``'s environment read with its owner's fsuid/fsgid (see the module's notes)."""
    try:
        uids, gids = p.uids(), p.gids()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if len({uids.real, uids.effective, uids.saved}) != 1 or len({gids.real, gids.effective, gids.saved}) != 1:
        return None  # the kernel would refuse a process whose ids differ: do not try
    with _as_owner(uids.real, gids.real):
        try:
            return p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            return None


@contextlib.contextmanager
def _as_owner(uid: int, gid: int) -> Iterator[None]:
    """File accesses of this thread with ``uid``/``gid`` as its file-system ids, then root's again."""
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    try:
        yield
    finally:  # setfsuid/setfsgid report no errors; back to root's, checked
        _libc.setfsuid(0)
        _libc.setfsgid(0)
        if _libc.setfsuid(-1) != 0 or _libc.setfsgid(-1) != 0:
            raise SystemExit("elasticd: could not take back its own file-system ids; stopping")


def describe(p: psutil.Process) -> Proc | None:
    env = _environ(p)
    if env is None:
        return None
    role = env.get("MS_ROLE", "")
    try:
        rank = int(env.get("RANK_ID", "-1")) if role == "MS_WORKER" else -1
        return Proc(p.pid, p.create_time(), role, rank)
    except (psutil.NoSuchProcess, ValueError):
        return None


def marked(markers: str | set[str]) -> list[psutil.Process]:
    """Every live process whose environment carries one of these markers (a generation's)."""
    wanted = {markers} if isinstance(markers, str) else markers
    found = []
    for p in psutil.process_iter():
        env = _environ(p)
        if env is not None and env.get(ENV_RUN_ID) in wanted:
            found.append(p)
    return found


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_boot_time: list[float] = []


def _stat(pid: int, create_time: float) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is the state), or None
    when no such process exists or ``pid`` is another process now (its start differs from
    ``create_time``, psutil's). One read: the supervisor looks at every rank ten times a second, and
    psutil's ``Process(pid)`` reads that file and ``/proc/stat`` again for each question."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20:
        return None
    # psutil's create_time is the same sum, with the boot time read afresh: it moves when the
    # clock is stepped, so a mismatch reads it again before it means another process.
    for fresh in (False, True):
        if fresh or not _boot_time:
            _boot_time[:] = [psutil.boot_time()]
        if abs(int(fields[19]) / _CLOCK_TICKS + _boot_time[0] - create_time) < 0.5 / _CLOCK_TICKS:
            return fields
    return None


def alive(pid: int, create_time: float) -> bool:
    """True while that process runs (a zombie counts as dead: it only waits to be reaped);
    ``create_time`` guards against a reused pid."""
    fields = _stat(pid, create_time)
    return fields is not None and fields[0] not in (b"Z", b"X")


async def wait_ended(processes: list[tuple[int, float]], timeout_s: float,
                     on_end: Callable[[], None] = lambda: None) -> None:
    """Wait until each of ``processes`` (pid, start time) has exited, ``timeout_s`` at most: on the
    kernel's word (a pidfd turns readable when its process exits), ``on_end()`` called at each end
    (a zombie's exit status is there to read until its parent reaps it)."""
    loop = asyncio.get_running_loop()
    pending: dict[int, int] = {}
    unwatched = []  # (no pidfd to be had but for it being gone: EMFILE, ENOMEM: looked at instead)
    for pid, start in processes:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # (gone already)
        except OSError:
            unwatched.append((pid, start))
            continue
        if alive(pid, start):  # (pinned: the pid is still that process)
            pending[fd] = pid
        else:
            os.close(fd)
    if not pending and not unwatched:
        return
    all_ended = asyncio.Event()

    def ended(fd: int) -> None:
        loop.remove_reader(fd)
        os.close(fd)
        del pending[fd]
        try:
            on_end()
        finally:
            if not pending and not unwatched:
                all_ended.set()

    async def look_at_unwatched() -> None:
        try:
            left = len(unwatched)
            while left:
                await asyncio.sleep(0.05)
                now = sum(alive(pid, start) for pid, start in unwatched)
                if now < left:
                    left = now
                    on_end()
        finally:
            unwatched.clear()
            if not pending:
                all_ended.set()

    for fd in pending:
        loop.add_reader(fd, ended, fd)
    looking = asyncio.create_task(look_at_unwatched()) if unwatched else None
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await within(all_ended.wait(), timeout_s)
    finally:
        if looking is not None:
            looking.cancel()
        for fd in list(pending):
            loop.remove_reader(fd)
            os.close(fd)
        pending.clear()


def gone(pid: int) -> bool:
    """No such process any more: it exited and its parent reaped it (a zombie is not gone)."""
    return not os.path.exists(f"/proc/{pid}")


def stopped(pid: int, create_time: float) -> str:
    """"T" while that process is stopped (SIGSTOP), "t" while a debugger holds it (a tracing stop:
    gdb, strace, py-spy dump), "" otherwise: stopped, it runs no code, and the ranks waiting for it
    in a collective hang with it."""
    fields = _stat(pid, create_time)
    return fields[0].decode() if fields is not None and fields[0] in (b"T", b"t") else ""


def exit_status(pid: int, create_time: float) -> int | None:
    """The exit code of a process that has exited but not been reaped yet (a zombie of another
    parent: msrun reaps its workers about once a second), from ``/proc/<pid>/stat``; None when
    it still runs, is gone or was killed by a signal (then: minus the signal number)."""
    fields = _stat(pid, create_time)
    if fields is None or fields[0] != b"Z" or len(fields) < 50:
        return None
    # The kernel shows 0 there to a reader that may not ptrace the process: root without
    # CAP_SYS_PTRACE (the unit) reading a rank of the worker user reads it with that user's ids.
    if os.geteuid() == 0 and _READ_AS:
        try:
            st = os.stat(f"/proc/{pid}")  # (the directory's owner: the process's euid and egid, zombie or not)
        except OSError:
            return None
        if _may_read_as(st.st_uid):
            with _as_owner(st.st_uid, st.st_gid):
                fields = _stat(pid, create_time)
            if fields is None or fields[0] != b"Z" or len(fields) < 50:
                return None
    status = int(fields[49])  # field 52, exit_code, as waitpid reports it
    return -(status & 0x7F) if status & 0x7F else status >> 8


def signal_groups(procs: list[psutil.Process], signum: int) -> None:
    groups = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except ProcessLookupError:
            continue
    for g in groups:
        if g in (0, 1, os.getpgid(0)):
            continue  # never our own group, never init's
        try:
            os.killpg(g, signum)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:  # a process may have changed group after we looked
        try:
            p.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


async def stop_generation(markers: str | set[str], extra: list[psutil.Process], grace_s: float,
                          poll_s: float = 0.05) -> list[int]:
    """Stop every process of the generation (those carrying its markers, and ``extra``); returns the
    pids still alive (should be none).

    ``grace_s == 0`` skips SIGTERM (a failed generation has nothing to save).
    """
    def live() -> list[psutil.Process]:
        procs = {p.pid: p for p in marked(markers)}
        for p in extra:
            procs.setdefault(p.pid, p)
        return [p for p in procs.values() if running(p)]

    procs = live()
    signal_groups(procs, signal.SIGCONT)
    if grace_s > 0:
        signal_groups(procs, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while procs and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            procs = live()
    for _ in range(3):
        if not procs:
            break
        signal_groups(procs, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while procs and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            procs = live()
    return [p.pid for p in procs]


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def disown(proc: asyncio.subprocess.Process) -> None:
    """Let ``proc``, a child started through asyncio, run on after elasticd: asyncio's transport
    kills a child it has not seen exit when it is closed or collected (BaseSubprocessTransport's
    close, also at interpreter exit), so the transport is told the child is done with first, then
    closed (its pipes). ``proc.returncode`` then reads -1. (Private to asyncio: a test in
    tests/integration/test_shim.py fails if a Python changes it.)"""
    transport = proc._transport  # type: ignore[attr-defined]
    if transport.get_returncode() is None:
        transport._returncode = -1
    transport.close()
