"""Bounded logs: a generation's log files (msrun's, the scheduler's, each rank's) never grow past
``max_log_mb`` each. A file of the job's own over it is rotated as the job's user (elasticd has
no CAP_DAC_OVERRIDE; and the folder is the job's: whatever it planted there, links included, a
rotation as its user only ever touches what that user may): at its first rotation its first
quarter-cap is kept as ``NAME.0`` (where a failure's root cause usually is: the start-up, the
first error), at every rotation its last half-cap as ``NAME.1`` (replacing the one before), and
the file is emptied in place. The writer keeps its descriptor: with O_APPEND it goes on at the
start; without (msrun's workers' files) at its offset, over a hole that takes no disk. So a log
costs at most one and three quarters caps of disk. A file there
that is not the job's user's is never touched by path (root would follow what the job planted):
msrun's own log, root's, is emptied through the descriptor elasticd opened it with (it holds
copies of the ranks' lines, which their own rotated logs keep)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import stat
from typing import Any, Callable

from mselastic.agent.containment.cgroups import Tree, join_prefix
from mselastic.agent.containment.users import WorkerUser, setpriv
from mselastic.core.waits import within

log = logging.getLogger(__name__)

#: How often the logs of the running generations are looked at.
CHECK_S = 2.0
#: How long one rotation may take (a copy of half a cap): then it is killed, and tried at the next look.
ROTATE_S = 60.0

#: Empties ``$2`` after keeping its first ``$3`` bytes in ``$2.0`` (once: the first rotation's) and
#: its last ``$1`` bytes in ``$2.1``.
_ROTATE = ('{ [ -e "$2.0" ] || { head -c "$3" -- "$2" > "$2.0.tmp" && mv -f -- "$2.0.tmp" "$2.0"; }; }; '
           'tail -c "$1" -- "$2" > "$2.1.tmp" && mv -f -- "$2.1.tmp" "$2.1" && truncate -s 0 -- "$2"')
#: Names of the kept parts (and their temporary files), which are not rotated themselves.
KEPT = (".0", ".0.tmp", ".1", ".1.tmp")


def oversized(folder: str, cap_bytes: int, uid: int) -> list[tuple[str, int, int]]:
    """(path, uid, gid) of each regular file of ``folder`` owned by ``uid`` (the job's user) that
    takes more than ``cap_bytes`` of disk (its blocks: a file emptied in place keeps its size over
    a hole), rotations aside."""
    found = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for e in entries:
        if e.name.endswith(KEPT):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid and st.st_blocks * 512 > cap_bytes:
            found.append((e.path, st.st_uid, st.st_gid))
    return found


async def rotate(path: str, uid: int, gid: int, keep_bytes: int, cgroups: Tree | None = None) -> None:
    """Rotate ``path`` (see the module's notes: ``keep_bytes`` of its end kept, half as many of
    its start at the first rotation) as ``uid``/``gid``, in a helper group of
    ``cgroups`` (:meth:`Tree.helper`: a job's process of that uid may take it over; it stays
    inside all the jobs' limits and is killed once done or late, :data:`ROTATE_S`; a job at its
    own process limit cannot keep it from running); errors are logged, never raised."""
    cmd = ["/bin/sh", "-c", _ROTATE, "rotate", str(keep_bytes), path, str(keep_bytes // 2)]
    owner = WorkerUser(str(uid), uid, gid, passwd=False)
    group = None
    try:
        if owner.switch:
            group = cgroups.helper("rotate") if cgroups else None
            cmd = [*join_prefix([group] if group else []), *setpriv(owner), *cmd]
        proc = await asyncio.create_subprocess_exec(*cmd, env={"PATH": "/usr/bin:/bin"}, cwd="/",
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await within(proc.communicate(), ROTATE_S)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode:
            log.warning("log %s not rotated: %s", path, err.decode(errors="replace").strip()[-300:])
        else:
            log.info("log %s was over its cap: its first %g MiB kept in %s.0 (at the first rotation), its last "
                     "%g MiB in %s.1, the file emptied", path, keep_bytes / 2**21, path, keep_bytes / 2**20, path)
    except (OSError, RuntimeError, asyncio.TimeoutError) as e:  # (RuntimeError: a CgroupError)
        log.warning("log %s not rotated: %s", path, e or "not done in time")
    finally:
        if group is not None:
            await group.stop()


def empty_if_over(fd: int, cap_bytes: int) -> bool:
    """Empty the file open as ``fd`` (msrun's log, O_APPEND: its writers go on at the start) once it
    takes more than ``cap_bytes`` of disk; True when it did."""
    if os.fstat(fd).st_blocks * 512 <= cap_bytes:
        return False
    os.ftruncate(fd, 0)
    return True


@dataclasses.dataclass(frozen=True)
class Logs:
    """A running generation's logs, as the cap sees them."""

    folder: str
    uid: int  # the job's user's: only its files are rotated
    msrun_fd: int = -1  # msrun's log, open for appending by elasticd (-1: none)
    ctx: dict[str, Any] = dataclasses.field(default_factory=dict)  # (its log lines')


async def cap(generations: list[Logs], cap_bytes: int, cgroups: Tree | None = None) -> None:
    """Rotate the job's files of each generation's folder over ``cap_bytes`` (the scan off the
    event loop), the generations side by side (one job's stalled rotation holds no other's)."""
    async def one(g: Logs) -> None:
        for path, owner, gid in await asyncio.to_thread(oversized, g.folder, cap_bytes, g.uid):
            await rotate(path, owner, gid, cap_bytes // 2, cgroups)

    await asyncio.gather(*(one(g) for g in generations))


async def keep_capped(running: Callable[[], list[Logs]], cap_bytes: int, stop: asyncio.Event,
                      cgroups: Tree | None = None) -> None:
    """Every :data:`CHECK_S` until ``stop``: for each generation ``running()`` names, msrun's log
    emptied and the job's own files rotated past ``cap_bytes`` (see :func:`rotate`)."""
    while cap_bytes and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CHECK_S):
                await stop.wait()
        generations = running()
        for g in generations:
            if g.msrun_fd >= 0 and empty_if_over(g.msrun_fd, cap_bytes):
                log.info("msrun's log was over max_log_mb: emptied", extra=g.ctx)
        await cap(generations, cap_bytes, cgroups)
