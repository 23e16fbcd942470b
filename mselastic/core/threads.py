"""Acting on every thread of this process (a nice value, a scheduling policy: per thread on Linux)."""

from __future__ import annotations

import os
from typing import Callable


def each_thread(act: Callable[[int], None]) -> list[tuple[int, OSError]]:
    """Call ``act`` with the id of every thread of this process, and again for threads started
    meanwhile (one of them may start another) until none is new. A thread that ended first is
    skipped; the other errors are returned, (thread id, error), never raised (0: the thread list
    itself could not be read)."""
    done: set[str] = set()
    failed: list[tuple[int, OSError]] = []
    try:
        while todo := set(os.listdir("/proc/self/task")) - done:
            for tid in todo:
                try:
                    act(int(tid))
                except ProcessLookupError:
                    pass  # (a thread that just ended)
                except OSError as e:
                    failed.append((int(tid), e))
            done |= todo
    except OSError as e:
        failed.append((0, e))
    return failed
