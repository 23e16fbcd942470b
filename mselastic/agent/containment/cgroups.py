"""Control groups: every process of a job lives in a cgroup of its own, whatever it does (#31).

elasticd makes its subtree, ``mselastic-<node>``, under the cgroup it runs in (never at a
hierarchy's root: a limit set above our own cgroup is not ours to set; under systemd the unit's
``Delegate=yes`` hands it that cgroup)::

    mselastic-<node>/<job>/            the job's limits: max_processes (pids), memory_limit_mb
    mselastic-<node>/<job>/pool-<id>/  a standby fork server and the standbys it forks
    mselastic-<node>/<job>/gen-<run>/  one generation: msrun, its scheduler, the ranks, and whatever
                                       they start (a standby moves here when handed the generation)

A process is put in its cgroup before it runs anything of the job's (:func:`join_prefix`: a shell
writes its own pid there as root, then execs setpriv and the command), and what it starts stays
there: clearing its environment, leaving its session or its process group changes nothing.
A generation is stopped by SIGTERM to its members, a grace period, then ``cgroup.kill`` and a wait
for ``cgroup.events`` to say ``populated 0``; the kernel, not a scan of ``/proc``, says who is left.

Two layouts are supported, and one log line says which was found:

- **v2** (``cgroup2`` at ``/sys/fs/cgroup``: Ubuntu 22.04+, Debian 12, RHEL 9): membership,
  ``cgroup.kill`` and the limits (``pids.max``, ``memory.max``) in one hierarchy; the controllers
  are enabled down the subtree (``cgroup.subtree_control``), processes live only in leaves, and
  an elasticd alone in a delegated cgroup moves itself into a leaf ``elasticd`` first.
- **hybrid** (v1 controllers with v2 beside them at ``/sys/fs/cgroup/unified``: RHEL 8 and the
  like): membership and ``cgroup.kill`` in v2, the limits in v1's ``memory``
  (``memory.limit_in_bytes``) and ``pids`` hierarchies, the same path in each.

Without v2 (pure v1) the ``pids`` hierarchy holds the membership and every member is SIGKILLed
until none is left. Without any (no cgroup file system, or elasticd may not write it: not
root, a container), elasticd says why and finds a generation's processes by the marker in their
environment (:mod:`mselastic.agent.containment.procs`), which a process that rewrites it escapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import select
import signal
import sys
import uuid
import time
from typing import Awaitable, Callable, Iterable, Iterator

import asyncinotify
import psutil

log = logging.getLogger(__name__)

#: The oom_score_adj of every process of a job (elasticd's unit has OOMScoreAdjust=-900, which
#: its children would inherit): under memory pressure the kernel kills a job before elasticd.
JOB_OOM_SCORE_ADJ = 500

#: Run as root before the job's command (``python -I -S -c``: no site, no environment read):
#: puts itself (its pid is the command's once it execs) in each cgroup named, sets its
#: oom_score_adj, then execs the rest of its arguments with its environment as it came, in its
#: order (a standby's handover rewrites the slot at its end; a shell would rebuild it).
_JOIN = """import os, sys
a = sys.argv
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write(a[1])
    n = int(a[2])
    for path in a[3:3 + n]:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    os.execv(a[3 + n], a[3 + n:])
except OSError as e:
    sys.stderr.write(f"mselastic-join: {e}\\n")
    os._exit(126)
"""


#: Processes of a group pinned (a pidfd each) at once to be signalled.
PINNED_AT_ONCE = 256


class CgroupError(RuntimeError):
    """A cgroup could not be made, joined or limited."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where elasticd's subtree is in each hierarchy it uses (absolute folders; "" none)."""

    mode: str  # "v2", "hybrid" or "v1"
    members: str  # the hierarchy whose cgroup.procs say who is in a group
    kill_file: bool  # cgroup.kill there (v2)
    memory: str = ""
    memory_v2: bool = False
    pids: str = ""
    pids_v2: bool = False

    def v2_limits(self) -> str:
        """The v2 controllers the limits need, as cgroup.subtree_control takes them ("" none)."""
        return " ".join(f"+{c}" for c, on in (("memory", self.memory_v2), ("pids", self.pids_v2)) if on)

    def roots(self) -> list[str]:
        return list(dict.fromkeys(r for r in (self.members, self.memory, self.pids) if r))

    def describe(self) -> str:
        limits = [f"{name} in {'v2' if v2 else 'v1'} at {os.path.dirname(path)}"
                  for name, path, v2 in (("memory", self.memory, self.memory_v2), ("pids", self.pids, self.pids_v2))
                  if path]
        return (f"{self.mode}: membership{' and cgroup.kill' if self.kill_file else ''} in {self.members}; "
                f"limits: {', '.join(limits) or 'none'}")


def exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (a zombie too), as the kernel says this instant."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def mounts(mountinfo: str) -> tuple[str, dict[str, str]]:
    """(the cgroup2 mount point or "", {v1 controller: its mount point}) from a mountinfo's text."""
    v2, v1 = "", dict[str, str]()
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        if rest[0] == "cgroup2" and not v2:
            v2 = fields[4]
        elif rest[0] == "cgroup":
            for option in rest[2].split(","):
                v1.setdefault(option, fields[4])
    return v2, v1


def own(proc_cgroup: str) -> dict[str, str]:
    """A process's cgroup per hierarchy, from its /proc/PID/cgroup: "" for v2, each v1 controller's name."""
    found = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            found[c] = path
    return found


def _subtree(mount: str, path: str, name: str) -> str:
    return os.path.join(mount, path.lstrip("/"), name)


def find(node_id: str) -> Layout | str:
    """The layout of this node's subtree (``mselastic-<node_id>``), made and writable; or why none."""
    try:
        v2, v1 = mounts(_read("/proc/self/mountinfo"))
        mine = own(_read("/proc/self/cgroup"))
    except OSError as e:
        return f"cannot read this process's cgroups: {e.strerror}"
    name = f"mselastic-{node_id}"
    members = memory = pids = ""
    memory_v2 = pids_v2 = kill_file = False
    mode = ""
    if v2 and "" in mine:
        candidate = _subtree(v2, mine[""], name)
        try:
            os.makedirs(candidate, exist_ok=True)
        except OSError as e:
            return f"cannot make {candidate}: {e.strerror}"
        if os.path.exists(os.path.join(candidate, "cgroup.kill")):  # (Linux 5.14+)
            members, kill_file = candidate, True
            controllers = set(_read_or(os.path.join(v2, mine[""].lstrip("/"), "cgroup.controllers")).split())
            if "memory" in controllers and "memory" not in v1:
                memory, memory_v2 = members, True
            if "pids" in controllers and "pids" not in v1:
                pids, pids_v2 = members, True
            mode = "hybrid" if {"memory", "pids"} & set(v1) else "v2"
        else:
            with contextlib.suppress(OSError):  # (one an earlier run left with groups in it stays)
                os.rmdir(candidate)
    if "memory" in v1 and "memory" in mine:
        memory = _subtree(v1["memory"], mine["memory"], name)
    if "pids" in v1 and "pids" in mine:
        pids = _subtree(v1["pids"], mine["pids"], name)
    if not members:
        if not pids:
            return "no cgroup v2 with cgroup.kill (Linux 5.14+) and no v1 pids hierarchy"
        members, mode = pids, "v1"
    try:
        os.makedirs(members, exist_ok=True)
    except OSError as e:
        return f"cannot make {members}: {e.strerror}"
    for name, path in (("memory", memory), ("pids", pids)):
        if path and path != members:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:  # (a container's v1 controllers are read-only: no limits, membership still)
                log.warning("cgroups: no %s limits for the jobs: cannot make %s (%s)", name, path, e.strerror)
                memory, pids = ("", pids) if name == "memory" else (memory, "")
    layout = Layout(mode, members, kill_file, memory, memory_v2, pids, pids_v2)
    if memory_v2 or pids_v2:
        why = _enable_v2(layout)
        if why:
            log.warning("cgroup v2 limits unavailable: %s; membership and cgroup.kill only", why)
            layout = dataclasses.replace(layout, memory="" if memory_v2 else memory,
                                         pids="" if pids_v2 else pids, memory_v2=False, pids_v2=False)
    return layout


def _read_or(path: str, default: str = "") -> str:
    try:
        return _read(path)
    except OSError:
        return default


def _enable_v2(layout: Layout) -> str:
    """Enable the v2 limit controllers for the subtree (in the cgroup elasticd runs in and in the
    subtree's root); "" when done, else why not. A cgroup with processes cannot hand controllers
    to its children (no internal processes): an elasticd alone in its (delegated) cgroup moves
    into a leaf ``elasticd`` of it first."""
    wanted = layout.v2_limits()
    parent = os.path.dirname(layout.members)
    if not os.path.exists(os.path.join(parent, "cgroup.type")):  # (only the hierarchy's root has none)
        enabled = set(_read_or(os.path.join(parent, "cgroup.subtree_control")).split())
        if not {w[1:] for w in wanted.split()} <= enabled:
            return f"elasticd runs in the hierarchy's root, whose controllers are not elasticd's to hand down"
    try:
        _write(os.path.join(parent, "cgroup.subtree_control"), wanted)
    except OSError as e:
        if e.errno != errno.EBUSY:
            return f"cannot enable {wanted} in {parent}: {e.strerror}"
        others = {int(p) for p in _read_or(os.path.join(parent, "cgroup.procs")).split()} - {os.getpid()}
        if others:
            return f"{parent} holds other processes ({len(others)}); give elasticd a cgroup of its own (Delegate=yes)"
        leaf = os.path.join(parent, "elasticd")
        try:
            os.makedirs(leaf, exist_ok=True)
            _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
            _write(os.path.join(parent, "cgroup.subtree_control"), wanted)
        except OSError as e2:
            return f"cannot move elasticd into {leaf} to enable {wanted}: {e2.strerror}"
    try:
        _write(os.path.join(layout.members, "cgroup.subtree_control"), wanted)
    except OSError as e:
        return f"cannot enable {wanted} in {layout.members}: {e.strerror}"
    return ""


def started_in_a_distributing_cgroup(layout: Layout) -> bool:
    """Whether elasticd moved itself out of the cgroup it was started in, into its leaf
    ``elasticd``, to hand the v2 limits' controllers down from there (see :func:`_enable_v2`):
    the launcher that started it there (systemd, for a unit) cannot start a successor there while
    a job lives below it (the kernel's no-internal-process rule)."""
    if layout.mode != "v2" or not layout.v2_limits():
        return False
    leaf = os.path.join(os.path.dirname(layout.members), "elasticd")
    return str(os.getpid()) in _read_or(os.path.join(leaf, "cgroup.procs")).split()


class Group:
    """One cgroup of the subtree (the same relative path in each hierarchy of the layout)."""

    def __init__(self, layout: Layout, rel: str) -> None:
        self.layout, self.rel = layout, rel

    def __repr__(self) -> str:
        return f"Group({self.rel!r})"

    def path(self, root: str) -> str:
        return os.path.join(root, self.rel) if self.rel else root

    def make(self) -> "Group":
        """Made in every hierarchy."""
        for root in self.layout.roots():
            try:
                os.makedirs(self.path(root), exist_ok=True)
            except OSError as e:
                raise CgroupError(f"cannot make cgroup {self.path(root)}: {e.strerror}") from None
        return self

    def enable_children_limits(self) -> None:
        """v2: hand the limit controllers to this group's children (a job's, above its leaves)."""
        wanted = self.layout.v2_limits()
        if wanted:
            try:
                _write(os.path.join(self.path(self.layout.members), "cgroup.subtree_control"), wanted)
            except OSError as e:
                raise CgroupError(f"cannot enable {wanted} under {self.rel}: {e.strerror}") from None

    def child(self, name: str) -> "Group":
        return Group(self.layout, os.path.join(self.rel, name) if self.rel else name)

    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to join this group in every hierarchy."""
        return [os.path.join(self.path(root), "cgroup.procs") for root in self.layout.roots()]

    def limit(self, memory_bytes: int, max_tasks: int) -> None:
        """Set the group's limits (0: none): memory in bytes, and processes and threads together."""
        lay = self.layout
        settings = []
        if lay.memory and memory_bytes:
            settings.append((os.path.join(self.path(lay.memory), "memory.max" if lay.memory_v2
                                          else "memory.limit_in_bytes"), str(memory_bytes)))
        if lay.pids and max_tasks:
            settings.append((os.path.join(self.path(lay.pids), "pids.max"), str(max_tasks)))
        for path, value in settings:
            try:
                _write(path, value)
            except OSError as e:
                raise CgroupError(f"cannot set {path} to {value}: {e.strerror}") from None

    def oom_kills(self) -> int:
        """How many of the group's processes the OOM killer has killed (its memory limit's)."""
        lay = self.layout
        if not lay.memory:
            return 0
        text = _read_or(os.path.join(self.path(lay.memory), "memory.events" if lay.memory_v2 else "memory.oom_control"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def move(self, pid: int, pidfd: int) -> None:
        """Put process ``pid`` (all its threads) in this group, while ``pidfd`` (opened when it was
        known to be that process: a standby's, when its fork server named it) says it has not
        exited, before and after each write (a number freed and reused meanwhile would have moved
        another process: CgroupError then, and the move is not trusted)."""
        for path in self.procs_files():
            if exited(pidfd):
                raise CgroupError(f"cannot move pid {pid} into {path}: it ended")
            try:
                _write(path, str(pid))
            except OSError as e:
                raise CgroupError(f"cannot move pid {pid} into {path}: {e.strerror}") from None
            if exited(pidfd):
                raise CgroupError(f"cannot move pid {pid} into {path}: it ended")

    def _folders(self) -> list[str]:
        """This group's folder in the membership hierarchy and every one below it, deepest first."""
        top = self.path(self.layout.members)
        found = []
        for folder, _, _ in os.walk(top, onerror=lambda e: None):
            found.append(folder)
        return sorted(found, key=lambda f: f.count(os.sep), reverse=True)

    def pids(self) -> set[int]:
        """The processes in this group and below it."""
        found: set[int] = set()
        for folder in self._folders():
            found.update(int(p) for p in _read_or(os.path.join(folder, "cgroup.procs")).split())
        return found

    def work(self) -> float | None:
        """Seconds of work this group's processes (every thread, children included) have done so
        far: their CPU time (``cpu.stat``) and the time some of them waited for a CPU or on I/O
        (``cpu.pressure``, ``io.pressure``: "some" totals; 0 where the kernel keeps no pressure).
        None without cgroup v2 membership, or when the group cannot be read."""
        if not self.layout.kill_file:
            return None
        top = self.path(self.layout.members)
        try:
            with open(os.path.join(top, "cpu.stat")) as f:
                usage = next(int(v) for k, v in (line.split() for line in f if line.strip()) if k == "usage_usec")
        except (OSError, ValueError, StopIteration):
            return None
        return (usage + _pressure(os.path.join(top, "cpu.pressure")) + _pressure(os.path.join(top, "io.pressure"))) / 1e6

    def populated(self) -> bool:
        top = self.path(self.layout.members)
        if self.layout.kill_file:
            events = _read_or(os.path.join(top, "cgroup.events"), "populated 0")
            return "populated 1" in events
        return bool(self.pids())

    def signal(self, signum: int) -> None:
        """``signum`` to every process in the group and below. A pid read from ``cgroup.procs`` may
        be another process's by the time it is signalled (its own ended, the number was reused):
        each is pinned first (a pidfd), the group read again, and only those still in it signalled
        through their pidfd (no process leaves a job's group by itself: ``cgroup.procs`` is root's)."""
        pids = sorted(self.pids())
        for at in range(0, len(pids), PINNED_AT_ONCE):  # (a descriptor each: a fork bomb's thousands)
            pinned: dict[int, int] = {}
            unpinned: list[int] = []  # (no pidfd to be had: no pidfd_open, no descriptor left)
            try:
                for pid in pids[at:at + PINNED_AT_ONCE]:
                    try:
                        pinned[pid] = os.pidfd_open(pid)
                    except ProcessLookupError:
                        pass  # ended meanwhile
                    except OSError:
                        unpinned.append(pid)
                still = self.pids()
                for pid, fd in pinned.items():
                    if pid in still:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            signal.pidfd_send_signal(fd, signum)
                for pid in unpinned:
                    if pid in still:  # (by its number, as the best left)
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(pid, signum)
            finally:
                for fd in pinned.values():
                    os.close(fd)

    def kill(self) -> None:
        """SIGKILL to every process in the group and below (v2: cgroup.kill, which nothing escapes
        by forking meanwhile; v1: each member, again at each look)."""
        top = self.path(self.layout.members)
        if self.layout.kill_file and os.path.isdir(top):
            try:
                _write(os.path.join(top, "cgroup.kill"), "1")
                return
            except OSError as e:
                log.warning("cgroup.kill of %s failed (%s); killing its members one by one", top, e.strerror)
        self.signal(signal.SIGKILL)

    def remove(self) -> bool:
        """Remove the group and every group below it (deepest first), in every hierarchy; False
        when one still holds a process."""
        ok = True
        for root in self.layout.roots():
            top = self.path(root)
            folders = [f for f, _, _ in os.walk(top, onerror=lambda e: None)]
            for folder in sorted(folders, key=lambda f: f.count(os.sep), reverse=True):
                try:
                    os.rmdir(folder)
                except FileNotFoundError:
                    pass
                except OSError:
                    ok = False
        return ok

    async def stop(self, extra: Iterable[psutil.Process] = (), grace_s: float = 0, poll_s: float = 0.02,
                   kill_within_s: float = 5.0) -> list[int]:
        """Stop every process of the group (and ``extra``, started for it but maybe elsewhere still:
        a standby not handed over yet): SIGCONT, with ``grace_s`` SIGTERM and that long to exit,
        then SIGKILL (cgroup.kill) and a wait until nothing is left; the group is removed then.
        Returns the pids still there (should be none)."""
        extra = list(extra)

        def left() -> bool:
            return self.populated() or any(_running(p) for p in extra)

        with self._emptying(bool(extra), poll_s) as emptied:
            for signum in (signal.SIGCONT, signal.SIGTERM) if grace_s > 0 else (signal.SIGCONT,):
                self.signal(signum)
                _send(extra, signum)
            if grace_s > 0:
                await emptied(left, grace_s)
            for _ in range(3):
                if not left():
                    break
                self.kill()
                _send(extra, signal.SIGKILL)
                await emptied(left, kill_within_s)
        remaining = sorted(self.pids() | {p.pid for p in extra if _running(p)})
        if not remaining:
            self.remove()
        return remaining


    @contextlib.contextmanager
    def _emptying(self, polled: bool, poll_s: float) -> Iterator[Callable[[Callable[[], bool], float], Awaitable[None]]]:
        """A wait until ``left()`` is false or a timeout passes: on cgroup v2 woken by the kernel
        (``cgroup.events`` is modified as the group empties: inotify, watched before anything is
        signalled, so no change is missed), else (v1, no inotify instance to be had) by looking
        every ``poll_s``; also every ``poll_s`` while ``polled`` (processes outside the group)."""
        events = os.path.join(self.path(self.layout.members), "cgroup.events") if self.layout.kill_file else ""
        watch: asyncinotify.Inotify | None = None
        if events:
            try:
                watch = asyncinotify.Inotify()
                watch.add_watch(events, asyncinotify.Mask.MODIFY)
            except OSError as e:  # (no such group yet; fs.inotify.max_user_instances reached)
                if watch is not None:
                    watch.close()
                watch = None
                if e.errno != errno.ENOENT:
                    log.debug("cgroup.events of %s not watched (%s): looked at every %gs", events, e, poll_s)

        async def emptied(left: Callable[[], bool], timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s
            while left() and (rest := deadline - time.monotonic()) > 0:
                if watch is None:
                    await asyncio.sleep(min(poll_s, rest))
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(poll_s, rest) if polled else rest):
                        await watch.get()

        try:
            yield emptied
        finally:
            if watch is not None:
                watch.close()


def _pressure(path: str) -> int:
    """The "some" total (microseconds) of a pressure file; 0 where there is none (PSI off)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _send(procs: list[psutil.Process], signum: int) -> None:
    for p in procs:
        try:
            p.send_signal(signum)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclasses.dataclass(frozen=True)
class Limits:
    """A job's limits on this node (0: none)."""

    memory_bytes: int = 0
    max_tasks: int = 0


class Tree:
    """This node's subtree: one group per job, its pools and generations under it."""

    def __init__(self, layout: Layout, all_jobs: Limits = Limits()) -> None:
        self.layout = layout
        self.root = Group(layout, "")
        #: The limits each job's group has (written again only when they change).
        self._limits: dict[str, Limits] = {}
        # Every job together (a job's own limit is up to the node's, several at once could reach
        # what elasticd and its etcd need; and a job may set its oom_score_adj back to elasticd's).
        try:
            self.root.enable_children_limits()
            self.root.limit(all_jobs.memory_bytes, all_jobs.max_tasks)
        except CgroupError as e:
            log.warning("cgroups: no limit on all the jobs together: %s", e)

    def job(self, job: str, limits: Limits) -> Group:
        """The job's group, made, its limits set (when they change: a spec submitted again). A limit
        the kernel refuses (below what the job's group uses now) is kept as it was, and logged."""
        group = self.root.child(job).make()
        if self._limits.get(job) != limits or not os.path.isdir(group.path(self.layout.members)):
            group.enable_children_limits()
            try:
                group.limit(limits.memory_bytes, limits.max_tasks)
                self._limits[job] = limits
            except CgroupError as e:
                log.warning("cgroups: job %s keeps its limits: %s", job, e, extra=dict(job=job))
        return group

    def forget(self, job: str) -> None:
        self._limits.pop(job, None)

    def helper(self, what: str) -> Group:
        """A group of its own for one helper elasticd starts as a job's user (a log rotation, a
        snapshot removal), made: under the subtree's root, held by the limits of all the jobs
        together but not by any one job's (a job at its own limits cannot keep it from running),
        named as no job can be (``.``); stop it once the helper is done (or late)."""
        return self.root.child(f".{what}-{uuid.uuid4().hex[:8]}").make()

    async def sweep(self, keep: Iterable[str] = ()) -> None:
        """Kill what an earlier elasticd of this node left in the subtree, and remove its groups,
        side by side, but the generations this elasticd adopted (``keep``: their groups' relative
        paths, ``<job>/gen-<run id>``; see agent.generation.adopt): what else is there was not adopted."""
        keep = set(keep)
        try:
            names = [n for n in os.listdir(self.layout.members) if os.path.isdir(os.path.join(self.layout.members, n))]
            groups = []
            for name in names:
                if not any(k.startswith(name + "/") for k in keep):
                    groups.append(self.root.child(name))
                    continue
                job = self.root.child(name).path(self.layout.members)
                groups += [self.root.child(f"{name}/{sub}") for sub in os.listdir(job)
                           if os.path.isdir(os.path.join(job, sub)) and f"{name}/{sub}" not in keep]
            left = set().union(*(g.pids() for g in groups)) if groups else set()
        except OSError as e:
            log.warning("cgroups: cannot look at %s: %s", self.layout.members, e)
            return
        if left:
            log.warning("cgroups: %d processes left by an earlier elasticd of this node in %s; killing them",
                        len(left), self.layout.members)
        await asyncio.gather(*(g.stop() for g in groups))

    async def close(self, keep: Iterable[str] = ()) -> None:
        """At elasticd's exit: kill anything left and remove the subtree, but the generations left to
        their shims (``keep``, as :meth:`sweep` takes it), and the folders above them."""
        keep = set(keep)
        await self.sweep(keep)
        if not keep:
            self.root.remove()


def join_prefix(groups: Iterable[Group], oom_score_adj: int = JOB_OOM_SCORE_ADJ) -> list[str]:
    """The command prefix (run as root, before setpriv) that puts the process in ``groups`` and sets
    its oom_score_adj; it exits 126 when it cannot."""
    files = [f for g in groups for f in g.procs_files()]
    return [sys.executable, "-I", "-S", "-c", _JOIN, str(oom_score_adj), str(len(files)), *files]


def setup(node_id: str, mode: str) -> Tree | None:
    """This node's tree per the ``cgroups`` setting: "off" (None), "auto" (None, with the reason
    logged, where none can be made), "required" (CgroupError where none can be made)."""
    if mode == "off":
        log.warning("cgroups = off: a generation's processes are found by the marker in their environment; "
                    "one that rewrites it outlives its job, and jobs have no memory or process limits")
        return None
    found = find(node_id)
    if isinstance(found, str):
        if mode == "required":
            raise CgroupError(found)
        log.warning("no cgroups (%s): a generation's processes are found by the marker in their environment; "
                    "one that rewrites it outlives its job, and jobs have no memory or process limits", found)
        return None
    log.info("cgroups %s", found.describe())
    memory, tasks = default_limits(0, 0)
    return Tree(found, Limits(memory, min(tasks * 2, _pid_max() - 1024)))


def node_memory_bytes() -> int:
    return int(psutil.virtual_memory().total)


def default_limits(memory_mb: int, max_tasks: int) -> tuple[int, int]:
    """The node's defaults for a job (settings of 0): its memory less a reserve for elasticd and
    the system (10 %, at least 1 GiB), and a quarter of the kernel's pid_max."""
    total = node_memory_bytes()
    memory = memory_mb * 2**20 if memory_mb else max(total - max(total // 10, 2**30), total // 2)
    return memory, max_tasks or max(1024, _pid_max() // 4)


def _pid_max() -> int:
    try:
        return int(_read("/proc/sys/kernel/pid_max"))
    except (OSError, ValueError):
        return 32768


def effective(spec_value: int, node_value: int) -> int:
    """A job's value of a limit: its spec's (0: the node's), never above the node's."""
    return min(spec_value, node_value) if spec_value else node_value

