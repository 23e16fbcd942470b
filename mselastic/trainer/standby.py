"""``python -m mselastic.trainer.standby``: a worker process started before it is needed.

A relaunch spends most of its time before MindSpore does anything: msrun's Python, then the
scheduler's and every worker's, each importing MindSpore (about 5 s of the 7 s a cold relaunch
takes on two cores). The agent keeps one standby per local rank, plus one for a scheduler, with
all of that done: it has imported MindSpore (and what training scripts import with it) and waits
on its standard input for one handover, a JSON line with what msrun would have given the process:

- ``env``: the variables to add (the generation's, and msrun's own: ``MS_ROLE``, ``RANK_ID``,
  ``MS_NODE_ID``, ``DEVICE_ID``, ``RANK_SIZE``, ``MS_WORKER_NUM``, ``MS_SCHED_HOST``,
  ``MS_SCHED_PORT``, ``MS_TOPO_TIMEOUT``);
- ``argv``: the script and its arguments; ``cwd``: the working directory;
- ``log``: the file msrun would have opened for its output (``worker_<rank>.log``,
  ``scheduler.log``), truncated as msrun does.

It then becomes that process (environment, output, working directory, ``sys.argv``,
``sys.path[0]``; it already runs in a session of its own, as msrun's children do) and runs the
script as ``__main__``; how it ends is the interpreter's doing, as for ``python script.py``. It is used once: a new standby replaces it.
Until the handover it carries no generation (no cluster variables, no heartbeat address), so it
can only ever join the generation it is handed. End of input before a handover: it exits 0.

Until the handover it runs at nice ``WAIT_NICE`` (19), when it may go back (CAP_SYS_NICE, or
an ``RLIMIT_NICE`` allowing its old value: the unit's ``LimitNICE=+0``): the replacements started
right after a relaunch import MindSpore on the cores the new generation trains on, and cost it
more than the relaunch itself (``make bench-goodput``). Handed a generation, every thread of it
goes back to the nice value it was started with. Nice weighs threads within one scheduling group:
where the kernel's autogroups apply (every session its own group) it does not hold a standby back
against the ranks (docs/DESIGN.md, "fourth part").

The kernel's view of its environment (``/proc/<pid>/environ``, what the agent, operators' tools
and the tests read to tell which generation a process is of) is the one it was started with. The
agent starts it with a reserved slot after its marker (``contract.ENV_STANDBY_SLOT``), and the handover writes
the generation's marker and msrun's variables into that memory, so a warm rank reads there like
one msrun started.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import sys
import threading
from typing import Any

from mselastic.core.contract import ENV_RUN_ID, ENV_STANDBY_SLOT, STANDBY_READY

#: Its nice value until the handover: the ranks that train meanwhile on the same cores go first
#: (replacement standbys importing MindSpore right after a relaunch slowed the new generation).
WAIT_NICE = 19

#: Imported before the handover: what a MindSpore training script imports first.
PRELOAD = ("mindspore", "mindspore.communication", "mindspore.nn", "mindspore.ops", "mindspore.dataset",
           "mindspore.dataset.vision", "mindspore.dataset.transforms", "mindspore.train", "numpy",
           "mselastic.trainer")


def _rewrite_environ_block(environ: dict[str, str]) -> bool:
    """Make the kernel's view of this process's environment (``/proc/<pid>/environ``: the block it
    was started with, ``/proc/self/stat``'s env_start..env_end) say ``environ``: the marker's entry and
    the reserved slot after it are rewritten in place, the marker with ``environ``'s and the slot with
    every variable the block lacks or has with another value. False when the block has no slot right
    after the marker or the entries do not fit (nothing is written then)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    if len(fields) < 49:
        return False
    env_start, env_end = int(fields[47]), int(fields[48])  # fields 50 and 51 of proc(5), counted from 1
    block = ctypes.string_at(env_start, env_end - env_start)
    marker, slot = f"{ENV_RUN_ID}=".encode(), f"{ENV_STANDBY_SLOT}=".encode()
    start = 0 if block.startswith(marker) else block.find(b"\0" + marker) + 1
    if start == 0 and not block.startswith(marker):
        return False
    slot_at = block.find(b"\0", start)  # the marker's end: the slot must follow it at once
    end = block.find(b"\0", slot_at + 1)  # the slot's end
    if slot_at < 0 or end < 0 or not block.startswith(slot, slot_at + 1):
        return False
    started = dict(e.decode(errors="surrogateescape").split("=", 1) for e in block.split(b"\0") if b"=" in e)
    entries = [f"{k}={v}".encode(errors="surrogateescape") for k, v in environ.items()
               if k not in (ENV_RUN_ID, ENV_STANDBY_SLOT) and started.get(k) != v]
    text = b"\0".join([marker + environ.get(ENV_RUN_ID, "").encode(), *entries]) + b"\0"
    # What is left of the slot stays a (shorter) slot entry: a run of NULs would end the block for
    # readers that stop at an empty entry (psutil does), hiding the variables after it.
    rest = end - start - len(text)
    if rest < len(slot) + 1:
        return False
    ctypes.memmove(env_start + start, text + slot + b"x" * (rest - len(slot)), end - start)
    return True


def _adopt_c_environment() -> None:
    """Take into ``os.environ`` what the imports set in the C environment (MindSpore's sets
    ``OMP_NUM_THREADS`` when unset): a process msrun starts inherits those from msrun, which has
    imported MindSpore too, and sees them in ``os.environ``."""
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    i = 0
    while environ[i] is not None:
        name, _, value = environ[i].decode(errors="surrogateescape").partition("=")
        if name and name not in os.environ:
            os.environ[name] = value
        i += 1


def become(handover: dict[str, Any]) -> None:
    """Turn this process into the one msrun would have started (see the module's notes)."""
    env: dict[str, str] = {str(k): str(v) for k, v in handover["env"].items()}
    argv: list[str] = [str(a) for a in handover["argv"]]
    log = os.open(handover["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(handover["cwd"])
    os.environ.pop(ENV_STANDBY_SLOT, None)  # (its bytes are about to hold other entries)
    os.environ.update(env)
    _rewrite_environ_block(dict(os.environ))
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))


def _wait_nicely() -> int | None:
    """Lower this process's priority to ``WAIT_NICE`` while it imports and waits, when it can raise
    it back at the handover: then the nice value to go back to, else None (it keeps its priority).

    Going back down takes CAP_SYS_NICE or an ``RLIMIT_NICE`` that allows the old value (the unit's
    ``LimitNICE=+0``); a thread of its own tries the round trip first, so that the process never
    lowers itself for good. Before the imports: the threads they start inherit the nice value of the
    thread that starts them (it is per thread on Linux)."""
    was = os.getpriority(os.PRIO_PROCESS, 0)
    if was >= WAIT_NICE:
        return None
    could: list[bool] = []

    def round_trip() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, WAIT_NICE)
            os.setpriority(os.PRIO_PROCESS, tid, was)
            could.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=round_trip, name="nice-probe")
    probe.start()
    probe.join()
    if not could:
        return None
    _renice(WAIT_NICE)
    return was


def _renice(nice: int) -> None:
    """Every thread of this process at ``nice``: at the handover, back to where it started (it is a
    rank now); before the imports, those that importing this package started (numpy's)."""
    done: set[str] = set()
    while todo := set(os.listdir("/proc/self/task")) - done:  # (again: one of them may have started another)
        for tid in todo:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except ProcessLookupError:
                pass  # (a thread that just ended)
            except OSError as e:  # (the round trip worked: not expected; slow beats dead)
                print(f"mselastic standby: thread {tid} not set to nice {nice}: {e}", file=sys.stderr, flush=True)
        done |= todo


def main() -> None:
    nice = _wait_nicely()
    for name in PRELOAD:
        __import__(name)
    _adopt_c_environment()
    print(STANDBY_READY, os.getpid(), flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)  # discarded before it was needed
    become(json.loads(line))
    if nice is not None:
        _renice(nice)
    # Uncaught exceptions go to the interpreter, as they would from `python script.py`: the
    # traceback, exit code 1, sys.last_value set for exit handlers.
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
