"""What an elasticd finds at its start that an earlier elasticd of this node left running (#45).

Every generation has a shim (:mod:`mselastic.agent.generation.shim`) that does not die with
elasticd: started cold, msrun's parent; warm, a guard beside ranks that are the children of the
job's fork server, which outlives elasticd while they run (``mselastic.trainer.standby.serve``).
After a crash the generation trains on, fenced by the shim on the deadline the dead elasticd last
wrote. A successor with the same ``work_dir`` and node id finds the
generation's record in its shim folder and adopts it (``NodeAgent._adopt``) when the shim and msrun
(warm: the shim; ranks that ended meanwhile are failures seen at once) still run, the deadline has not passed, and etcd still has the generation as the job's committed
plan with this node a member; anything else it finds there is killed and its files removed, as
the generations of an earlier elasticd were before shims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import logging
import os
import signal

from mselastic.agent.generation import shim
from mselastic.core import fencing

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Found:
    """One generation an earlier elasticd of this node started."""

    record: shim.Record
    paths: shim.Paths
    #: msrun and its shim, both still running, the deadline not passed (None: not adoptable), or
    #: (warm) its guard running and the ranks it names.
    child: shim.Child | shim.WarmRecord | None
    why_not: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return self.record.job, self.record.generation


#: The lock file in work_dir an elasticd holds for its life (daemon.main.lock_work_dir).
LOCK_NAME = ".elasticd.lock"


def in_use(work_dir: str) -> bool:
    """Whether an elasticd holds ``work_dir``'s lock now."""
    try:
        fd = os.open(os.path.join(work_dir, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False  # (no lock file, or no folder: nobody holds it)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # (and the lock taken, if it was)


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def find(shim_dir: str, work_dir: str, node_id: str, namespace: str = "") -> list[Found]:
    """The generations an earlier elasticd with this ``work_dir`` and node id left, in its shim
    folder (``shim_dir``; "": beside the logs), each said adoptable or not, and why; and, not
    adoptable, those of this node id and ``namespace`` whose elasticd ran with another work_dir
    and is gone (this one was started with a new work_dir: its predecessor's generations would
    run on beside a relaunch until their deadline)."""
    pattern = os.path.join(shim_dir, "*.shim.json") if shim_dir else os.path.join(work_dir, "logs", "*", "*.shim.json")
    found = []
    for path in sorted(glob.glob(pattern)):
        try:
            record = shim.Record.from_json(open(path).read())
        except (OSError, ValueError, TypeError) as e:
            log.warning("a shim's record %s cannot be read (%s): left alone", path, e)
            continue
        paths = shim.Paths(path.removesuffix(".shim.json"))
        if record.node != node_id:
            continue  # (another elasticd's on this machine)
        if record.work_dir != work_dir and not _same_folder(record.work_dir, work_dir):
            if namespace and record.namespace == namespace and not in_use(record.work_dir):
                found.append(Found(record, paths, None, f"its elasticd, with work_dir {record.work_dir}, is gone, and "
                                                        f"this one runs with work_dir {work_dir}"))
            continue  # (else another elasticd's on this machine, alive)
        child: shim.Child | shim.WarmRecord | None = shim.Child.read(paths) or shim.WarmRecord.read(paths)
        why = ""
        if child is None:
            why = "it has neither msrun under its shim nor a warm record (started by an earlier release, or " \
                  "its elasticd ended while it started)"
        elif not child.alive():
            why = "its shim or msrun is gone" if isinstance(child, shim.Child) else "its shim is gone"
        else:
            try:
                over = fencing.clock() - shim.read_deadline(paths)
            except (OSError, ValueError) as e:
                over, why = 0.0, f"its deadline cannot be read ({e})"
            if not why and over >= 0:
                why = f"its fence deadline passed {over:.1f}s ago"
        found.append(Found(record, paths, None if why else child, why))
    return found


def discard(found: Found) -> list[int]:
    """Kill what is left of a generation not adopted (its shim first: it might fence or exit as
    msrun did meanwhile; warm, the fork server of its ranks too: it forks for that elasticd alone)
    and remove its files; the pids left."""
    child = found.child or shim.Child.read(found.paths) or shim.WarmRecord.read(found.paths)
    if child is not None:
        shim.signal_pinned(child.shim, child.shim_start, signal.SIGKILL)
    if isinstance(child, shim.WarmRecord):
        shim.signal_pinned(child.server, child.server_start, signal.SIGKILL)
    elif child is None and (guard := shim.guard_of(found.paths)) is not None:  # (its elasticd ended before .warm)
        shim.signal_pinned(*guard, signal.SIGKILL)
    left = shim.kill(found.record)
    for path in found.paths.all():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return left
