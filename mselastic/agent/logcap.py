"""Bounded logs: a generation's log files (msrun's, the scheduler's, each rank's) never grow past
``max_log_mb`` each. A file over it is rotated as its owner (a job's file is the job's user's,
mode 0640, and elasticd has no CAP_DAC_OVERRIDE; running as the owner also means whatever the
job made of its folder, links included, only ever touches its own files): its last half-cap is
kept as ``NAME.1`` (replacing the one before), and the file is emptied in place. The writer keeps
its descriptor: with O_APPEND it goes on at the start; without (msrun's workers' files) at its
offset, over a hole that takes no disk. So a log costs at most one and a half caps of disk."""

from __future__ import annotations

import asyncio
import logging
import os
import stat

from mselastic.agent.users import WorkerUser, setpriv

log = logging.getLogger(__name__)

#: How often the logs of the running generations are looked at.
CHECK_S = 10.0

#: Empties ``$2`` after keeping its last ``$1`` bytes in ``$2.1``.
_ROTATE = 'tail -c "$1" -- "$2" > "$2.1.tmp" && mv -f -- "$2.1.tmp" "$2.1" && truncate -s 0 -- "$2"'


def oversized(folder: str, cap_bytes: int) -> list[tuple[str, int, int]]:
    """(path, owner uid, gid) of each regular file of ``folder`` that takes more than ``cap_bytes``
    of disk (its blocks: a file emptied in place keeps its size over a hole), rotations aside."""
    found = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for e in entries:
        if e.name.endswith((".1", ".1.tmp")):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_blocks * 512 > cap_bytes:
            found.append((e.path, st.st_uid, st.st_gid))
    return found


async def rotate(path: str, uid: int, gid: int, keep_bytes: int) -> None:
    """Rotate ``path`` (see the module's notes) as ``uid``/``gid``; errors are logged, never raised."""
    cmd = ["/bin/sh", "-c", _ROTATE, "rotate", str(keep_bytes), path]
    owner = WorkerUser(str(uid), uid, gid, passwd=False)
    if owner.switch:
        cmd = [*setpriv(owner), *cmd]
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, env={"PATH": "/usr/bin:/bin"}, cwd="/",
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        if proc.returncode:
            log.warning("log %s not rotated: %s", path, err.decode(errors="replace").strip()[-300:])
        else:
            log.info("log %s was over its cap: its last %d MiB kept in %s.1, the file emptied", path,
                     keep_bytes >> 20, path)
    except (OSError, asyncio.TimeoutError) as e:
        log.warning("log %s not rotated: %s", path, e)


async def cap(folders: list[str], cap_bytes: int) -> None:
    """Rotate every file of ``folders`` over ``cap_bytes`` (the scan off the event loop)."""
    for folder in folders:
        for path, uid, gid in await asyncio.to_thread(oversized, folder, cap_bytes):
            await rotate(path, uid, gid, cap_bytes // 2)
