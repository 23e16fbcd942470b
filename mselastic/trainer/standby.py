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

The process the agent starts is a *fork server* (:func:`serve`): it imports once, then forks a
standby for each request (a file descriptor passed with it becomes the standby's standard input,
output and error), reaps them and tells the agent how each ended. A forked standby takes a
session of its own and the parent-death signal (its server; the server dies with elasticd),
writes its own marker into the kernel's view of its environment, and reseeds numpy (Python's
``random`` reseeds itself after a fork): the state a process msrun starts would have. The server
does not die with elasticd: once elasticd's end of its socket closes (a restart, a crash) it
forks no more, kills what it forked but the ranks elasticd told it to keep (those of a generation
a successor can adopt), and stays while one of those runs, recording how each ends in a file of
the job's (``contract.ENV_STANDBY_EXITS``) for the elasticd that adopts the generation; then it
exits. The
server's other threads are not copied. Importing MindSpore 2.10 on CPU starts one: numpy's
OpenBLAS thread server (``blas_thread_server``, seen with gdb), which shuts its threads down
before a fork and starts them again when needed (its ``pthread_atfork`` handler). The scheduler,
training, datasets, checkpoints and the CPU collectives run in forked standbys in every warm test
(``tests/integration/test_warm.py``, ``tests/integration/test_faults.py``, ``tests/integration/test_elastic.py``).

Until the handover it runs at nice ``WAIT_NICE`` (19), when it may go back (CAP_SYS_NICE, or
an ``RLIMIT_NICE`` allowing its old value: the unit's ``LimitNICE=+0``): the replacements started
right after a relaunch import MindSpore on the cores the new generation trains on, and cost it
more than the relaunch itself (``make bench-goodput``). Handed a generation, every thread of it
goes back to the nice value it was started with. Nice weighs threads within one scheduling group:
where the kernel's autogroups apply (every session its own group) it does not hold a standby back
against the ranks (docs/DESIGN.md, "Performance model"; the measurements in the journal).

The kernel's view of its environment (``/proc/<pid>/environ``, what the agent, operators' tools
and the tests read to tell which generation a process is of) is the one it was started with. The
agent starts it with a reserved slot after its marker (``contract.ENV_STANDBY_SLOT``), and the handover writes
the generation's marker and msrun's variables into that memory, so a warm rank reads there like
one msrun started.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
from typing import Any

from mselastic.core.contract import (ENV_GENERATION, ENV_JOB, ENV_RUN_ID, ENV_STANDBY_EXITS, ENV_STANDBY_SLOT,
                                     STANDBY_FORKS, STANDBY_READY)
from mselastic.core.pdeathsig import die_with_parent
from mselastic.core.threads import each_thread

#: Its nice value until the handover: the ranks that train meanwhile on the same cores go first
#: (replacement standbys importing MindSpore right after a relaunch slowed the new generation).
WAIT_NICE = 19

#: Imported before the handover: what a MindSpore training script imports first.
PRELOAD = ("mindspore", "mindspore.communication", "mindspore.nn", "mindspore.ops", "mindspore.dataset",
           "mindspore.dataset.vision", "mindspore.dataset.transforms", "mindspore.train", "numpy",
           "mselastic.trainer")


def _entries(block: bytes) -> dict[str, str]:
    """The variables of an environment block (NUL-separated ``NAME=value`` entries)."""
    return dict(e.decode(errors="surrogateescape").split("=", 1) for e in block.split(b"\0") if b"=" in e)


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
    started = _entries(block)
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


def retitle(args: list[str]) -> None:
    """What ``ps`` shows for this process: ``/proc/<pid>/cmdline`` reads the bytes of the arguments
    it was started with (``/proc/self/stat``'s arg_start..arg_end), rewritten here in place as
    ``args`` (NUL-separated, as arguments are), cut to their length (about 55 bytes: a venv's
    python, ``-m``, this module), as setproctitle does. Python's own ``sys.argv`` is a copy and stays
    as it is. (MindSpore names a process in its log lines by the first argument's base name, read
    there at every line: the setproctitle package writes the title as one argument, and a warm
    rank's lines then read ``ME(pid,tid,python mselastic:lenet:g2:rank0 train.py --data /…)``,
    tried 2026-12-07; here the first argument stays ``python``, as a cold rank's.)"""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5), counted from 1
    except (OSError, ValueError, IndexError):
        return
    if end - start < 2:
        return
    data = b"\0".join(a.encode(errors="replace") for a in args)[:end - start - 1]
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _title(env: dict[str, str] | os._Environ[str], argv: list[str]) -> list[str]:
    """A handed-over process's arguments as ps shows them: ``python``, as a cold rank's first one
    (MindSpore's log lines name it so), what it is (``mselastic:<job>:g<generation>:rank<N>`` or
    ``:scheduler``), then the script and its arguments."""
    role = f"rank{env.get('RANK_ID', '?')}" if env.get("MS_ROLE") == "MS_WORKER" else "scheduler"
    script = [os.path.basename(argv[0]), *argv[1:]] if argv else []
    return ["python", f"mselastic:{env.get(ENV_JOB, '?')}:g{env.get(ENV_GENERATION, '?')}:{role}", *script]


def _job_of(marker: str) -> str:
    return marker.split(".")[1] if marker.count(".") >= 3 else "?"


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
    retitle(_title(os.environ, argv))
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
    for tid, e in each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice)):
        # (the round trip worked: not expected; slow beats dead)
        print(f"mselastic standby: thread {tid} not set to nice {nice}: {e}", file=sys.stderr, flush=True)


def serve(control: socket.socket, exits: int = -1) -> tuple[int, str, int]:
    """The fork server's loop: fork a standby for each request of the agent, and tell it when one
    exits (this process is their parent, so it reaps them).

    A request is one message: a JSON object ``{"fork": marker}`` with one file descriptor (the new
    standby's end of a socket pair: its standard input, output and error). Each answer is a line
    ``STANDBY_FORKS {"forked": pid, "marker": marker}`` (or ``{"error": why, "marker": marker}``),
    and ``{"exit": pid, "code": c}`` when a child ended (``c`` as asyncio gives it: negative for a
    signal), that also to ``exits`` (a file of the job's, ``contract.ENV_STANDBY_EXITS``: -1 none).
    ``{"keep": [pid, ...], "marker": m}`` (no descriptor; answered ``{"kept": n, "marker": m}``)
    names children that are ranks of a generation a successor of elasticd may adopt (its record
    is written). A request it cannot serve (a fork refused for want of memory or processes, a
    malformed message) is answered with an error: the loop never raises, since the ranks it forked
    die with it. Once the agent has closed ``control`` (elasticd restarting, or gone) the server
    forks no more, SIGKILLs every child it forked that it was not told to keep (a generation whose
    record was never written has no guard either: it must not train on unfenced), and stays while
    a kept one runs, reaping it into ``exits``; then it exits (whatever else the job's code
    started in it aside). Returns only in a forked child: its descriptor, its marker and this
    server's pid."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # (handled: it wakes the select)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    server = os.getpid()
    agent: list[socket.socket] = [control]  # (emptied once the agent is gone)
    forked: set[int] = set()  # (children it forked, not reaped yet: a pid no other process can have)
    keep: set[int] = set()
    while True:
        for key, _ in sel.select():
            if key.fileobj is not control:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 512):
                        pass
                _reap(agent, exits, forked)
                if not agent and not forked & keep:
                    sys.exit(0)  # the agent is gone and no rank it kept is left
                continue
            fds: list[int] = []
            marker = ""
            try:
                msg, fds, _, _ = socket.recv_fds(control, 4096, 1)
                if not msg:
                    raise EOFError
                what = json.loads(msg)
                marker = str(what.get("marker", what.get("fork", "")))
                if "keep" in what:
                    for fd in fds:
                        os.close(fd)
                    keep |= {int(pid) for pid in what["keep"]} & forked
                    _tell(agent, exits, {"kept": len(keep), "marker": marker})
                    continue
                marker = str(what["fork"])
                if len(fds) != 1:
                    raise ValueError(f"expected one file descriptor, got {len(fds)}")
                pid = os.fork()
            except (EOFError, ConnectionError):
                # The agent is done with us, or gone: its idle standbys' ends are closed too (they
                # would exit), the ranks it kept run on for the next elasticd (ours is their death
                # signal); the rest go now.
                sel.unregister(control)
                agent.clear()
                for pid in forked - keep:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)  # (not reaped yet: still ours)
                _reap(agent, exits, forked)
                if not forked & keep:
                    sys.exit(0)
                continue
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                for fd in fds:
                    os.close(fd)
                _tell(agent, exits, {"error": f"{type(e).__name__}: {e}", "marker": marker})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sel.close()
                os.close(wake_r)
                os.close(wake_w)
                if exits >= 0:
                    os.close(exits)
                control.detach()  # (fd 0 is about to be the child's own socket)
                return fds[0], marker, server
            forked.add(pid)
            os.close(fds[0])
            _tell(agent, exits, {"forked": pid, "marker": marker})


def _reap(agent: list[socket.socket], exits: int, forked: set[int]) -> None:
    """Reap every child that has ended, and tell of each it forked."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in forked:
            continue  # (a process the job's code started in the server)
        forked.discard(pid)
        what = {"exit": pid, "code": os.waitstatus_to_exitcode(status)}
        if exits >= 0:
            with contextlib.suppress(OSError):  # (one write, appended whole)
                os.write(exits, (json.dumps(what) + "\n").encode())
        _tell(agent, -1, what)


def _tell(agent: list[socket.socket], exits: int, what: dict[str, Any]) -> None:
    """One line to the agent, while it is there (a broken connection: it is gone, see :func:`serve`)."""
    if not agent:
        return
    try:
        agent[0].sendall(f"{STANDBY_FORKS} {json.dumps(what)}\n".encode())
    except OSError:
        agent.clear()


def open_exits() -> int:
    """The file the server records its children's ends in (``contract.ENV_STANDBY_EXITS``; -1: none
    given, or it cannot be opened: the agent still hears of them while it runs)."""
    path = os.environ.pop(ENV_STANDBY_EXITS, "")
    if not path:
        return -1
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        print(f"mselastic standby: {path} not opened ({e}): a successor of elasticd cannot read how the ranks "
              f"ended", file=sys.stderr, flush=True)
        return -1


def _child(fd: int, marker: str, server: int) -> None:
    """Just forked: become a standby of our own (a session, the death signal, standard streams,
    the marker, fresh random state), as one started on its own would be."""
    os.setsid()
    die_with_parent(parent=server)  # the fork server's end is ours (it outlives elasticd while we run)
    for target in (0, 1, 2):
        os.dup2(fd, target)
    os.close(fd)
    with open("/proc/self/environ", "rb") as f:
        started = _entries(f.read())
    os.environ[ENV_RUN_ID] = marker
    _rewrite_environ_block({**started, ENV_RUN_ID: marker})  # the kernel's view too: the marker only
    retitle(["mselastic-standby", _job_of(marker), "(idle)"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # (Python's own random reseeds itself after a fork; numpy's does not)
        numpy.random.seed()


def main() -> None:
    marker = os.environ.get(ENV_RUN_ID, "")
    retitle(["mselastic-standby-server", _job_of(marker)])
    nice = _wait_nicely()
    for name in PRELOAD:
        __import__(name)
    _adopt_c_environment()
    print(STANDBY_READY, os.getpid(), flush=True)
    fd, marker, server = serve(socket.socket(fileno=0), open_exits())
    _child(fd, marker, server)
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
