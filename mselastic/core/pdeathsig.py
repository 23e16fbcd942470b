"""Parent-death signal: the process chain elasticd -> the generation's shim -> msrun -> workers
dies together.

msrun and the embedded etcd are started through util-linux's ``setpriv
--pdeathsig KILL`` (never a Python ``preexec_fn``: running ctypes in a child
forked from the multi-threaded daemon can crash it); the trainer library sets
the signal in each worker itself, whose parent is msrun. So a SIGKILLed
elasticd leaves no msrun, worker, scheduler or embedded etcd behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal

_PR_SET_PDEATHSIG = 1


def with_parent_death(cmd: list[str], switch: list[str] | None = None) -> list[str]:
    """``cmd`` prefixed so that it is SIGKILLed when the process that starts it dies; with
    ``switch`` (setpriv's options that change the user: ``--reuid``, ``--regid`` and the groups),
    run as that user (setpriv sets the death signal after changing the credentials, which would
    clear it). The switch is setpriv's, not a fork that calls setuid in elasticd: a forked copy
    of a process running gRPC's threads may crash before it execs (seen: msrun and mkdir children
    dying with SIGSEGV), a vfork'ed setpriv does not."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("setpriv (util-linux) not found: install util-linux")
    return [setpriv, *(switch or []), "--pdeathsig", "KILL", "--", *cmd]


def as_user(cmd: list[str], switch: list[str] | None = None) -> list[str]:
    """``cmd`` run as the user ``switch`` names (setpriv's options, as for :func:`with_parent_death`),
    without a parent-death signal: a process that outlives elasticd (a standby fork server whose
    forks are a generation's ranks, adopted by the next elasticd)."""
    if not switch:
        return cmd
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("setpriv (util-linux) not found: install util-linux")
    return [setpriv, *switch, "--", *cmd]


def die_with_parent(signum: int = signal.SIGKILL, parent: int = 0) -> None:
    """Ask for ``signum`` when this process's parent dies (call in the process itself). ``parent``:
    the pid it must be (a process just forked knows its parent's; read after the fork, a parent
    that died meanwhile would be its new one's)."""
    parent = parent or os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
