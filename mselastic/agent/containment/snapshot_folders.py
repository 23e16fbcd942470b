"""Each job's in-memory snapshot folder on this node: made safely for the worker user, removed when
the job is gone (see :mod:`mselastic.trainer.checkpoint` for what the ranks keep there)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
import time

from mselastic.agent.containment.cgroups import Tree, join_prefix
from mselastic.agent.containment.users import WorkerUser, setpriv
from mselastic.core.waits import within

log = logging.getLogger(__name__)

#: A job's snapshot folder untouched this long is removed (see :func:`snapshot_folder`).
SNAPSHOT_KEEP_S = 24 * 3600.0


def snapshot_folder(root: str, job: str, user: WorkerUser | None) -> str:
    """This node's in-memory folder for ``job``'s snapshots (see
    :mod:`mselastic.trainer.checkpoint`): ``root`` (and its parent) elasticd's own, that nobody
    else may write, then ``job``, the worker user's, mode 0700. Raises OSError when one is not
    what it must be (a path in a world-writable /dev/shm may be anyone's)."""
    for d in (os.path.dirname(root), root):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
            os.chmod(d, 0o711)  # (the umask took the others' x: the worker user passes through)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise OSError(f"{d} is not a folder of elasticd's own that only it may write")
    path = os.path.join(root, job)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)  # inside a folder only elasticd writes: what is checked here stays so
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a folder")
    if user is not None and user.switch and (st.st_uid, st.st_gid) != (user.uid, user.gid):
        os.chown(path, user.uid, user.gid, follow_symlinks=False)
    return path


async def remove_snapshot_folder(path: str, cgroups: Tree | None = None) -> None:
    """Remove a job's snapshot folder, off the event loop: its content as the folder's owner (the
    worker user or the job's uid, mode 0700; elasticd has no CAP_DAC_OVERRIDE under the unit),
    then the folder itself from elasticd's own. The removal as the owner runs in a helper group
    of ``cgroups`` (:meth:`Tree.helper`: a job's process of that uid may take it over; it stays
    inside all the jobs' limits, and whatever it started there is killed once it ends, or after
    its time). Errors are logged, never raised."""
    group = None
    try:
        st = await asyncio.to_thread(os.lstat, path)
        user = WorkerUser(f"uid {st.st_uid}", st.st_uid, st.st_gid, passwd=False)
        if user.switch:
            group = cgroups.helper("cleanup") if cgroups else None
            proc = await asyncio.create_subprocess_exec(
                *join_prefix([group] if group else []), *setpriv(user), "find", path, "-xdev", "-mindepth", "1",
                "-delete", env={"PATH": "/usr/bin:/bin"}, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE)
            _, err = await within(proc.communicate(), 300)
            if proc.returncode:
                raise OSError(err.decode(errors="replace").strip()[-300:] or f"find exited {proc.returncode}")
            await asyncio.to_thread(os.rmdir, path)
        else:
            await asyncio.to_thread(shutil.rmtree, path)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - memory left behind is logged, never a crash
        log.warning("snapshot folder %s not removed: %s", path, e)
    finally:
        if group is not None:
            await group.stop()


async def sweep_snapshot_folders(root: str, keep: set[str], cgroups: Tree | None = None) -> None:
    """Folders of jobs that failed for good, were stopped or deleted are memory nobody reads:
    removed once untouched for ``SNAPSHOT_KEEP_S`` (a training job's is written every few steps);
    never the ``keep`` ones (jobs running here)."""
    try:
        entries = await asyncio.to_thread(lambda: [(e.name, e.stat(follow_symlinks=False).st_mtime,
                                                    e.is_dir(follow_symlinks=False)) for e in os.scandir(root)])
    except OSError:
        return
    for name, mtime, is_dir in entries:
        if name not in keep and is_dir and time.time() - mtime > SNAPSHOT_KEEP_S:
            await remove_snapshot_folder(os.path.join(root, name), cgroups)
