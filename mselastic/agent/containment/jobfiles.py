"""Files a job controls, read by elasticd (root) without trusting them (issue #31).

A job's script may put anything where elasticd looks: a FIFO (an ``open()`` that never returns), a
symlink to ``/dev/zero`` or to another job's file, a huge sparse file; its storage (NFS) may hang.
So a job's file is opened without following a final symlink and without blocking, read only when
it is a regular file of bounded size, and every such read runs in a thread of its own that elasticd
neither waits for beyond a deadline nor at exit (a hung read never holds the event loop, the
threads other work needs, or a shutdown), with few such reads in flight at once.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from typing import Callable, TypeVar

from mselastic.core.waits import within

T = TypeVar("T")

#: A manifest or ``latest.json`` is a few hundred bytes: more is not one.
SMALL_FILE_BYTES = 1 << 20
#: How long elasticd waits for one read of a job's files.
READ_S = 2.0
#: Reads of job files in flight at most (each may be stuck in the kernel): past that, none starts.
IN_FLIGHT = 8

_in_flight = threading.BoundedSemaphore(IN_FLIGHT)


class Unreadable(OSError):
    """Not read: not a regular file, too large, not answering in time, or too many reads stuck."""


def read_small(path: str, limit: int = SMALL_FILE_BYTES) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes (never through a
    final symlink, never blocking on a FIFO or a device); raises OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path} is not a regular file")
        if st.st_size > limit:
            raise Unreadable(f"{path} is larger than {limit} bytes")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise Unreadable(f"{path} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def read_tail(path: str, limit: int, since: int = 0) -> bytes:
    """The last ``limit`` bytes of ``path`` (none before byte ``since``) when it is a regular file
    (never through a final symlink, never blocking on a FIFO or a device); raises OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path} is not a regular file")
        start = max(since, st.st_size - limit, 0)
        return os.pread(fd, max(0, st.st_size - start), start)
    finally:
        os.close(fd)


async def bounded(fn: Callable[..., T], *args: object, within_s: float = READ_S,
                  slots: threading.BoundedSemaphore | None = None) -> T:
    """``fn(*args)`` (which reads a job's files) in a daemon thread of its own, for ``within_s`` at
    most; raises :class:`Unreadable` when it takes longer (the thread is left to finish or hang on
    its own: nothing waits for it, not even elasticd's exit) or when :data:`IN_FLIGHT` reads are
    still stuck (``slots``: another budget than the launches' and submits', for reads that may
    wait, the jobs table's)."""
    in_flight = slots if slots is not None else _in_flight
    if not in_flight.acquire(blocking=False):
        raise Unreadable("too many reads of job files are not answering; not reading more")
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    done.add_done_callback(lambda f: f.cancelled() or f.exception())  # (an answer after the deadline: dropped)

    def settle(value: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)  # type: ignore[arg-type]

    def work() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, error = None, e
        finally:
            in_flight.release()
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is closed: elasticd is gone, nobody waits
            pass

    try:
        threading.Thread(target=work, name="job-file-read", daemon=True).start()
    except RuntimeError:  # (no thread to be had: the slot is not kept)
        in_flight.release()
        raise Unreadable("no thread to read with") from None
    try:
        return await within(asyncio.shield(done), within_s)
    except asyncio.TimeoutError:
        raise Unreadable(f"no answer within {within_s:.0f}s (storage not answering)") from None
