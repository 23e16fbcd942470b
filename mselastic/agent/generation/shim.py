"""The generation's shim: a small process per generation, apart from elasticd, that holds the
fence where the generation is. elasticd keeps a deadline in a file (``<shim_dir>/<run id>.deadline``,
in elasticd's own folder on /run, see ``daemon.main.shim_dir``: the lease the workers run on, plus
the outage grace, on ``CLOCK_BOOTTIME``) and moves it on with every renewal; the shim reads it four
times a second and, once it has passed, kills the generation (its cgroup, and every process
carrying its markers) and writes why (``.fenced``).
elasticd frozen (a SIGSTOP, a debugger, swap storms), its event loop stuck, or the machine
suspended: the deadline stops moving, and the generation ends itself before a leader may replace
it (``fencing.fenced_within``), with or without systemd's watchdog.

It runs half a round behind elasticd's own deadline check (:func:`lag_s`), so that a live elasticd
fences first and reports the fence as such; elasticd reads ``.fenced`` too, and a generation the
shim ended is reported self-fenced, not failed.

What the shim shares with elasticd is versioned (``RECORD_VERSION``): the generation's record
(``.shim.json``: who it is, what to kill), the deadline and the fence. A record of a version
this shim does not know is refused with one line, and the shim exits (elasticd then fences by
itself, as before there were shims).

On the cold path the shim is msrun's parent (``-- CMD``): it starts msrun in a session of its
own, tells elasticd msrun's pid (one line on its stdout), records how msrun ended (``.exit``)
and then exits the way msrun did (its code, or killed by the same signal), so that elasticd's
wait on it is a wait on msrun. msrun's parent-death signal is the shim's: the generation lives
as long as its shim. On the warm path (standbys of the fork server, no msrun) it only guards.

A shim that is msrun's parent outlives elasticd (no parent-death signal of its own): after a
crash its generation trains on, fenced by the shim on the last deadline written, and a successor
adopts it (:mod:`mselastic.agent.generation.adopt`; ``.child`` says who to adopt). A shim that only guards
(warm: the ranks are the children of the job's fork server, which outlives elasticd while they
run) outlives elasticd too, and the successor adopts by ``.warm`` (:class:`WarmRecord`). Run
as ``python -I -m
mselastic.agent.generation.shim RECORD [--stdout-fd N] [--pass-fd N] [--cwd DIR] [-- CMD...]`` (``-I``: it
runs as root, and nothing of the job's folders may come first on its import path); SIGTERM ends
a shim that only guards (elasticd sends it when the generation is over).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import psutil

from mselastic.agent.containment import procs
from mselastic.agent.generation import stop
from mselastic.agent.containment.cgroups import Group, Layout
from mselastic.core import fencing

log = logging.getLogger("mselastic.agent.generation.shim")  # (the same name when run as __main__)

RECORD_VERSION = 1
#: How often the shim reads the deadline.
POLL_S = 0.25


def lag_s(ttl_s: float) -> float:
    """How long after elasticd's own deadline the shim fences: half a round (elasticd's check runs
    every quarter second; the leader waits a round, a probe and the kill more: fencing_within)."""
    return fencing.round_s(ttl_s) / 2


@dataclasses.dataclass(frozen=True)
class Record:
    """The generation as the shim knows it. ``paths``: the files beside its log folder."""

    job: str
    generation: int
    node: str
    markers: list[str]
    ttl_s: float
    cgroup_layout: dict[str, Any] | None = None
    cgroup_rel: str = ""
    read_as: int = -1  # the worker user's uid (-1: the workers run as elasticd)
    #: The generation's run id and the work_dir of the elasticd that started it (a successor
    #: adopts only the generations of its own work_dir and node id: agent.generation.adopt).
    run_id: str = ""
    work_dir: str = ""
    #: Its elasticd's etcd namespace: a successor with another work_dir kills the generations of
    #: its node and namespace whose elasticd is gone (agent.generation.adopt).
    namespace: str = ""
    version: int = RECORD_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Record":
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
            raise ValueError(f"record version {raw.get('version') if isinstance(raw, dict) else '?'}, this shim "
                             f"reads version {RECORD_VERSION}")
        return cls(**raw)

    def group(self) -> Group | None:
        return Group(Layout(**self.cgroup_layout), self.cgroup_rel) if self.cgroup_layout else None


@dataclasses.dataclass(frozen=True)
class Paths:
    """The shim's files: ``base`` and a suffix each, in a folder of elasticd's alone (the worker
    user must not move its own deadline)."""

    base: str

    @property
    def record(self) -> str:
        return self.base + ".shim.json"

    @property
    def deadline(self) -> str:
        return self.base + ".deadline"

    @property
    def fenced(self) -> str:
        return self.base + ".fenced"

    @property
    def exit(self) -> str:
        return self.base + ".exit"

    @property
    def child(self) -> str:
        return self.base + ".child"

    @property
    def warm(self) -> str:
        return self.base + ".warm"

    @property
    def guard(self) -> str:
        return self.base + ".guard"

    def all(self) -> list[str]:
        return [self.record, self.deadline, self.fenced, self.exit, self.child, self.warm, self.guard]


def write_atomically(path: str, text: str) -> None:
    stop.write_atomically(path, text.encode())  # (elasticd's alone: 0600)


def write_deadline(paths: Paths, until: float) -> None:
    write_atomically(paths.deadline, json.dumps({"version": RECORD_VERSION, "until": until}))


def read_deadline(paths: Paths) -> float:
    raw = json.loads(open(paths.deadline).read())
    if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION or not isinstance(raw.get("until"), float):
        raise ValueError(f"not a deadline of version {RECORD_VERSION}: {raw!r:.80}")
    return raw["until"]


def fence_reason(paths: Paths) -> str | None:
    """Why the shim fenced the generation (None: it has not)."""
    try:
        raw = json.loads(open(paths.fenced).read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"fenced by its shim (the record is unreadable: {e})"
    return str(raw.get("reason", "fenced by its shim")) if isinstance(raw, dict) else "fenced by its shim"


@dataclasses.dataclass(frozen=True)
class Child:
    """What a shim that is msrun's parent wrote of itself and msrun (``.child``), each by pid and
    start time (a pid alone may be another process's by now)."""

    shim: int
    shim_start: float
    pid: int
    start: float

    @classmethod
    def read(cls, paths: Paths) -> "Child | None":
        try:
            raw = json.loads(open(paths.child).read())
            if raw.get("version") != RECORD_VERSION:
                return None
            return cls(int(raw["shim"]), float(raw["shim_start"]), int(raw["pid"]), float(raw["start"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def alive(self) -> bool:
        """The shim and msrun both still run (the same processes)."""
        return all(same(pid, start) for pid, start in ((self.shim, self.shim_start), (self.pid, self.start)))


@dataclasses.dataclass(frozen=True)
class WarmRecord:
    """What elasticd wrote of a warm generation once its ranks were handed it and its shim guards
    it (``.warm``): the shim; the fork server whose children the ranks are (it outlives elasticd
    while they run), its cgroup (relative: a successor's sweep keeps it) and the file it records
    their ends in; each local rank's process and node_rank 0's scheduler's. Each process by pid
    and start time. A successor adopts the generation by it (:mod:`mselastic.agent.generation.adopt`)."""

    shim: int
    shim_start: float
    server: int
    server_start: float
    exits: str
    ranks: dict[int, tuple[int, float]]
    scheduler: tuple[int, float] | None = None
    server_group: str = ""

    def write(self, paths: Paths) -> None:
        raw = dict(dataclasses.asdict(self), version=RECORD_VERSION, ranks={str(r): list(p) for r, p in self.ranks.items()})
        write_atomically(paths.warm, json.dumps(raw, sort_keys=True))

    @classmethod
    def read(cls, paths: Paths) -> "WarmRecord | None":
        try:
            raw = json.loads(open(paths.warm).read())
            if raw.pop("version") != RECORD_VERSION:
                return None
            sched = raw.get("scheduler")
            return cls(int(raw["shim"]), float(raw["shim_start"]), int(raw["server"]), float(raw["server_start"]),
                       str(raw["exits"]), {int(r): (int(p[0]), float(p[1])) for r, p in raw["ranks"].items()},
                       (int(sched[0]), float(sched[1])) if sched else None, str(raw.get("server_group", "")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            return None

    def alive(self) -> bool:
        """Its shim still runs (the same process); the ranks may have ended meanwhile (a failure
        the successor sees at once)."""
        return same(self.shim, self.shim_start)


def guard_of(paths: Paths) -> tuple[int, float] | None:
    """The guard shim of a warm generation, as it wrote itself (``.guard``): pid and start time."""
    try:
        raw = json.loads(open(paths.guard).read())
        return (int(raw["shim"]), float(raw["shim_start"])) if raw.get("version") == RECORD_VERSION else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def exited(pidfd: int) -> bool:
    """The process of ``pidfd`` has ended (poll, not select: a busy daemon's descriptors pass 1024)."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def signal_pinned(pid: int, start: float, signum: int) -> bool:
    """``signum`` to ``pid`` if it is still the process started at ``start`` (pinned by a pidfd
    before the check: a number reused meanwhile is never signalled); whether it was sent."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if not same(pid, start):
            return False
        signal.pidfd_send_signal(fd, signum)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def same(pid: int, start: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - start) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class AdoptedShim:
    """The shim of a generation an earlier elasticd started (a successor adopts it): not this
    process's child, so watched through a pidfd; its code is msrun's, from ``.exit`` (none there:
    killed, -SIGKILL)."""

    def __init__(self, pid: int, start: float, paths: Paths) -> None:
        self.pid, self.paths = pid, paths
        self._fd = os.pidfd_open(pid)
        self._code: int | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        if not same(pid, start):  # (pinned first: the number may be another's by now)
            os.close(self._fd)
            raise ProcessLookupError(f"the shim (pid {pid}) is gone")

    @property
    def returncode(self) -> int | None:
        if self._code is None and self._fd >= 0 and exited(self._fd):
            try:
                self._code = int(json.loads(open(self.paths.exit).read())["code"])
            except (OSError, ValueError, KeyError, TypeError):
                self._code = -signal.SIGKILL
            if self._waiters:
                self._ended()
            os.close(self._fd)
            self._fd = -1
        return self._code

    async def wait(self) -> int:
        """Until it has ended (its pidfd readable: the kernel's word) or :meth:`close`, then its code."""
        if self._code is None and self._fd >= 0:
            loop = self._loop = asyncio.get_running_loop()
            if not self._waiters:
                loop.add_reader(self._fd, self._ended)
            waiter = loop.create_future()
            self._waiters.append(waiter)
            await waiter
        code = self.returncode
        assert code is not None
        return code

    def _ended(self) -> None:
        """Its pidfd turned readable, or it is closed: every wait goes on."""
        if self._fd >= 0 and self._loop is not None:
            self._loop.remove_reader(self._fd)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _send(self, signum: int) -> None:
        if self._fd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._fd, signum)

    def terminate(self) -> None:
        self._send(signal.SIGTERM)

    def close(self) -> None:
        """Its pidfd closed (the generation is over): a wait under way or still to come returns at once."""
        if self._fd >= 0 and self.returncode is None:  # (what .exit says, if it has ended)
            self._code = -signal.SIGKILL  # (else as it will be: the generation was torn down)
        if self._fd >= 0:
            if self._waiters:
                self._ended()
            os.close(self._fd)
            self._fd = -1

    def kill(self) -> None:
        self._send(signal.SIGKILL)


class Handle:
    """elasticd's side of one generation's shim: start it, move its deadline on, stop it."""

    def __init__(self, base: str, ctx: dict[str, Any]) -> None:
        self.paths, self._ctx = Paths(base), ctx
        self.proc: asyncio.subprocess.Process | AdoptedShim | None = None
        self._until, self._gone, self._ended = 0.0, False, False
        #: Why the shim fenced the generation, once read (its files go with the generation).
        self._why: str | None = None
        #: msrun's parent (its end is msrun's), or a guard alone (its end is unexpected).
        self._parent = False

    def prepare(self, record: Record, until: float) -> None:
        """Write the record and the deadline (before the shim starts)."""
        for path in self.paths.all():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        write_atomically(self.paths.record, record.to_json())
        write_deadline(self.paths, until)
        self._until = until

    def adopt(self, child: Child) -> AdoptedShim:
        """The shim an earlier elasticd started for this generation, msrun's parent (raises
        OSError when it is gone meanwhile)."""
        self.proc, self._parent = AdoptedShim(child.shim, child.shim_start, self.paths), True
        with contextlib.suppress(OSError, ValueError):
            self._until = read_deadline(self.paths)
        return self.proc

    def adopt_guard(self, warm: WarmRecord) -> AdoptedShim:
        """The shim an earlier elasticd started to guard this (warm) generation (raises OSError
        when it is gone meanwhile)."""
        self.proc, self._parent = AdoptedShim(warm.shim, warm.shim_start, self.paths), False
        with contextlib.suppress(OSError, ValueError):
            self._until = read_deadline(self.paths)
        return self.proc

    def command(self, stdout_fd: int = -1, pass_fds: tuple[int, ...] = (), cwd: str = "",
                env_fd: int = -1) -> list[str]:
        """The shim's command line; followed by ``--`` and a command, it starts that as its child."""
        cmd = [sys.executable, "-I", "-m", "mselastic.agent.generation.shim", self.paths.record]
        cmd += ["--stdout-fd", str(stdout_fd)] if stdout_fd >= 0 else []
        cmd += ["--env-fd", str(env_fd)] if env_fd >= 0 else []
        cmd += [a for fd in pass_fds for a in ("--pass-fd", str(fd))]
        return cmd + (["--cwd", cwd] if cwd else [])

    async def guard(self) -> None:
        """Start the shim alone (the warm path: it need not be up before the launch; it finds the
        generation's processes by their cgroup and markers when it fences). It outlives elasticd,
        as the ranks do (their fork server does: see :class:`WarmRecord`)."""
        self.proc = await asyncio.create_subprocess_exec(*self.command(), stdin=asyncio.subprocess.DEVNULL,
                                                         start_new_session=True)

    async def parent(self, proc: asyncio.subprocess.Process) -> int:
        """``proc``, the shim started with a command (stdout a pipe): the child's pid, once it
        says it (raises RuntimeError with its reason when the child could not be started)."""
        self.proc, self._parent = proc, True
        assert proc.stdout is not None
        line = (await proc.stdout.readline()).decode().strip()
        if not line.isdigit():
            await proc.wait()
            raise RuntimeError(line or f"its shim exited with {proc.returncode}")
        return int(line)

    def extend(self, until: float) -> None:
        """Move the deadline on (written when it changed; nothing before the shim is started, and
        never once the last one written has passed: the shim may be fencing now)."""
        if self._until and fencing.clock() >= self._until:
            return
        if self.proc is not None and not self._ended and until != self._until:
            write_deadline(self.paths, until)
            self._until = until

    def fenced(self) -> str | None:
        """Why the shim fenced the generation (None: it has not). A guard gone without a fence
        while the generation runs is logged once: elasticd alone fences it from then on (a shim
        that is msrun's parent ends with msrun, and msrun with it)."""
        proc = self.proc
        if proc is None or self._ended or self._why is not None:
            return self._why
        self._why = fence_reason(self.paths)
        if self._why is None and proc.returncode is not None and not self._parent and not self._gone:
            self._gone = True
            log.error("the generation's shim (pid %d) exited with %s; elasticd alone fences the generation",
                      proc.pid, proc.returncode, extra=self._ctx)
        return self._why

    def leave(self) -> None:
        """elasticd leaves the generation to its shim (a planned restart, see agent.generation.adopt): its
        handle on the shim closes and nothing is signalled; the shim's files stay, for the next
        elasticd to adopt the generation by, and the deadline stays where the last renewal put it."""
        self._ended = True
        if isinstance(self.proc, AdoptedShim):
            self.proc.close()
        elif self.proc is not None:
            procs.disown(self.proc)

    def end(self) -> None:
        """The generation is over: the shim is asked to end (SIGTERM; asyncio reaps it), and its
        files go (what it recorded is in the generation's report by now)."""
        self.fenced()  # (read before its files go)
        self._ended = True
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
        if isinstance(self.proc, AdoptedShim):
            self.proc.close()
        for path in self.paths.all():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def kill(record: Record) -> list[int]:
    """SIGKILL to the generation (its cgroup, and every process carrying its markers but the shim,
    which carries them when it is msrun's parent), until none is left or ``fencing.KILL_S`` has
    passed; the pids left."""
    group, markers = record.group(), set(record.markers)
    deadline = time.monotonic() + fencing.KILL_S
    while True:
        if group is not None:
            group.kill()
        left = [p for p in procs.marked(markers) if p.pid != os.getpid()]
        procs.signal_groups(left, signal.SIGKILL)
        pids = sorted((group.pids() if group is not None else set()) | {p.pid for p in left if procs.running(p)})
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.02)


def exit_like(code: int) -> int:
    """Exit as a child that ended with ``code`` did (negative: killed by that signal)."""
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL's cannot be set, nor need be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)  # (a signal whose default is not to end the process: say it in the code)
        return 128 - code
    return code


def watch(record: Record, paths: Paths, ctx: dict[str, Any], child: subprocess.Popen[bytes] | None = None) -> int:
    """Fence the generation once its deadline has passed; 0 once asked to end (SIGTERM). With
    ``child`` (msrun), also wait for it: its end is recorded and the shim's code is its code."""
    lag, until, said = lag_s(record.ttl_s), 0.0, ""
    pidfd = os.pidfd_open(child.pid) if child is not None else -1
    while True:
        try:  # (read every time: a few bytes on /run; a file's time may not change between two writes)
            until, said = read_deadline(paths), ""
        except FileNotFoundError:
            pass  # (removed as the generation ends) the last one read stands
        except (OSError, ValueError) as e:  # never extended by what cannot be read
            if str(e) != said:
                log.error("deadline unreadable (%s); the last one read stands", e, extra=ctx)
                said = str(e)
        over = fencing.clock() - until
        if until and over >= lag:
            why = (f"{fencing.Rule.OUTAGE_TOO_LONG.value}: elasticd did not move the deadline on; "
                   f"{over:.1f}s past it (its shim fenced the generation)")
            log.error("self-fencing: %s", why, extra=ctx)
            left = kill(record)  # (first: nothing the writes below meet may hold it up)
            try:
                write_atomically(paths.fenced, json.dumps({"version": RECORD_VERSION, "reason": f"self-fenced: {why}",
                                                           "at": fencing.clock()}))
            except OSError as e:
                log.error("the fence's record %s not written: %s", paths.fenced, e, extra=ctx)
            if left:
                log.error("processes left after the fence: %s", left, extra=ctx)
                return 1
            return 0 if child is None else exit_like(child.wait())
        if child is None:
            time.sleep(POLL_S)
        elif select.select([pidfd], [], [], POLL_S)[0]:  # (the shim's own few descriptors: select will do)
            code = child.wait()
            try:
                write_atomically(paths.exit, json.dumps({"version": RECORD_VERSION, "pid": child.pid, "code": code}))
            except OSError as e:
                log.error("msrun's end (%d) not recorded in %s: %s", code, paths.exit, e, extra=ctx)
            return exit_like(code)


def start_child(cmd: list[str], stdout_fd: int, pass_fds: list[int], cwd: str, env_fd: int,
                paths: Paths, ctx: dict[str, Any]) -> subprocess.Popen[bytes]:
    """msrun, in a session of its own, its output where elasticd said, its environment the one
    elasticd wrote to ``env_fd`` (JSON; -1: the shim's); its pid on our stdout."""
    env = None
    if env_fd >= 0:
        with os.fdopen(env_fd, "rb") as f:
            env = json.loads(f.read())
        if not isinstance(env, dict):
            raise ValueError("the child's environment is not a JSON object")
    out = stdout_fd if stdout_fd >= 0 else None
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=pass_fds,
                             cwd=cwd or None, env=env, start_new_session=True)
    for fd in {stdout_fd, *pass_fds} - {-1}:
        os.close(fd)
    try:  # (who to adopt, for elasticd's successor: the shim and its child, each by its start time)
        write_atomically(paths.child, json.dumps({"version": RECORD_VERSION, "shim": os.getpid(),
                                                  "shim_start": psutil.Process().create_time(), "pid": child.pid,
                                                  "start": psutil.Process(child.pid).create_time()}))
    except (OSError, psutil.Error) as e:
        log.error("the child's record %s not written (%s): a successor of elasticd cannot adopt it", paths.child, e,
                  extra=ctx)
    print(child.pid, flush=True)
    return child


def main(argv: list[str]) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s job=%(job)s gen=%(generation)s node=%(node)s "
                               "rank=-: %(message)s")
    parser = argparse.ArgumentParser(prog="python -I -m mselastic.agent.generation.shim",
                                     description="A generation's shim (elasticd starts it; see agent/generation/shim.py).")
    parser.add_argument("record", help="the generation's record, <logs>/<job>/g<N>.shim.json")
    parser.add_argument("--stdout-fd", type=int, default=-1, help="the child's stdout and stderr (msrun.log)")
    parser.add_argument("--pass-fd", type=int, action="append", default=[], help="a descriptor the child keeps")
    parser.add_argument("--cwd", default="", help="the child's working folder")
    parser.add_argument("--env-fd", type=int, default=-1, help="the child's environment, JSON (default: the shim's)")
    parser.epilog = "After --: the child (msrun), whose parent the shim is."
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.cmd = cmd
    ctx = dict(job="-", generation="-", node="-")
    try:
        record = Record.from_json(open(args.record).read())
    except (OSError, ValueError, TypeError) as e:
        if args.cmd:  # (elasticd waits for the child's pid on our stdout)
            print(f"the generation's record {args.record} cannot be used ({e})", flush=True)
        log.error("shim not started: the generation's record %s cannot be used (%s); elasticd alone fences it",
                  args.record, e, extra=ctx)
        return 2
    ctx = dict(job=record.job, generation=str(record.generation), node=record.node)
    if record.read_as > 0:
        procs.read_as(record.read_as)
    child = None
    if args.cmd:
        # msrun's end is the shim's: a SIGTERM to the generation's process groups must not end the
        # shim first (msrun's parent-death signal would kill it, and the ranks with it, unsaved).
        # A handler, not SIG_IGN: the child does not inherit it.
        signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            child = start_child(args.cmd, args.stdout_fd, args.pass_fd, args.cwd, args.env_fd,
                                Paths(args.record.removesuffix(".shim.json")), ctx)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            print(f"{args.cmd[0]} could not be started: {e}", flush=True)
            return 127
    else:  # (SIGTERM ends a shim that guards alone)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:  # (who it is, for a successor that finds no .warm record: it kills the guard too)
            write_atomically(Paths(args.record.removesuffix(".shim.json")).guard, json.dumps(
                {"version": RECORD_VERSION, "shim": os.getpid(), "shim_start": psutil.Process().create_time()}))
        except (OSError, psutil.Error) as e:
            log.error("the guard's record not written (%s)", e, extra=ctx)
    return watch(record, Paths(args.record.removesuffix(".shim.json")), ctx, child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
