"""How a generation's ranks are told to stop at a step: the stop file they read once signalled,
and SIGCONT + SIGTERM to each (the step itself is chosen by the coordinator, or by the agent when
every rank is its own: :func:`mselastic.core.contract.stop_step_ahead`)."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from typing import Iterable

from mselastic.agent.containment import procs
from mselastic.agent.generation.ranks import RankState
from mselastic.core import contract


def write_atomically(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it (never through a link),
    ``mode`` whatever the umask, renamed over it. Raises OSError (nothing left behind)."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(fd, mode)
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_stop_step(path: str, step: int) -> None:
    """Write ``step`` to ``path`` atomically, in elasticd's own folder, readable by the worker user
    whatever the umask. Raises OSError (nothing left behind)."""
    write_atomically(path, contract.encode_stop_step(step), 0o644)


def signal_ranks(ranks: Iterable[RankState]) -> list[RankState]:
    """SIGCONT (a stopped rank ignores SIGTERM) and SIGTERM to every live rank of ``ranks``;
    returns those signalled."""
    live = [rs for rs in ranks if rs.pid and procs.alive(rs.pid, rs.create_time)]
    for rs in live:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rs.pid, sig)
    return live
