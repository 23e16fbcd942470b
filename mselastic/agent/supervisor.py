"""Runs one generation of a job on this node under msrun, and watches it.

The supervisor starts ``msrun`` in a new session (with a parent-death signal,
so msrun dies with elasticd), the venv's ``bin`` first on PATH, a log directory
of its own, and the ``MSELASTIC_*`` variables of the trainer contract. It then
watches the workers themselves, not only msrun: msrun notices a dead rank only
after its scheduler times out (~35 s). A worker that is gone (or a zombie)
without having said ``finished``, or silent for longer than the hang timeout,
fails the generation at once; the supervisor then tears down every process of
the generation and reports.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import json
import logging
import os
import hashlib
import re
import ipaddress
import signal
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable

import psutil
import tenacity

from mselastic import metrics
from mselastic.agent import procs
from mselastic.agent import verdict
from mselastic.agent.standby import Proc, Standby
from mselastic.agent.users import WorkerUser, batch_prefix, inherited_env, setpriv
from mselastic.core import contract
from mselastic.core.contract import Beat, BeatKind
from mselastic.core.pdeathsig import with_parent_death
from mselastic.core.model import GenerationReport, Plan
from mselastic.core.spec import JobSpec, forbidden_env
from mselastic.core.states import FailureCause, GenerationState, check_generation_transition

log = logging.getLogger(__name__)


#: Datagrams read per wake-up of the socket's reader; the rest wait for the next turn of the loop.
MAX_BEATS_PER_READ = 256

#: struct ucred: pid, uid, gid (SCM_CREDENTIALS).
_CREDS = struct.Struct("3i")


def _sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
            return int(_CREDS.unpack(data[:_CREDS.size])[0])
    return -1


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT does not count
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


@dataclasses.dataclass
class RankState:
    rank: int
    pid: int = 0
    create_time: float = 0.0
    last_beat: float = 0.0  # monotonic
    step: int = -1
    loss: float = 0.0
    finished: bool = False
    #: Step this rank checkpointed at before exiting on SIGTERM (-1: it did not).
    exit_step: int = -1
    #: Exit code seen before msrun reaped it (None: not seen).
    exit_code: int | None = None
    #: Since when (monotonic) the rank is seen stopped (state T); 0 while it is not.
    stopped_since: float = 0.0
    #: Start-up phases reached (index into Beat.PHASES; a first step counts as past them all), and when.
    phase: int = -1
    phase_at: dict[int, float] = dataclasses.field(default_factory=dict)
    #: Step it resumed from (its ``start`` beat), -1 until then.
    resumed_step: int = -1
    #: Why it cannot go on (its ``fatal`` beat), "" if it did not say.
    fatal: str = ""
    #: Sent ``NUDGE_SIGNAL`` (once: still inside init() after a local peer got through).
    nudged: bool = False


#: MindSpore's cluster heartbeat interval (seconds, drawn from [lower, upper]; its default is 3..5).
#: ``init()`` returns only at the first heartbeat after the cluster has formed, so the default
#: costs 3-5 s of every launch: measured (msrun, 2 ranks, median of 3) ``init()`` 5.4 s -> 2.1 s
#: and launch to first step 12.2 s -> 8.8 s at 1..1. Above 256 workers (MindSpore's own bound
#: for a large cluster) every worker's beat loads the one scheduler: its default is kept there.
FAST_HEARTBEAT_MAX_WORKERS = 256

#: A rank still inside ``init()`` this long after a local peer returned from it is asleep in MindSpore's
#: CPU collective address exchange (``contract.NUDGE_SIGNAL``): it is nudged. The rest of ``init()``
#: after the exchange takes a few milliseconds.
NUDGE_AFTER_S = 0.1
_JOINED = Beat.PHASES.index("joined")

#: A stop the agent names for its own ranks covers the steps they make in this long (the SIGTERM
#: reaches a rank busy in a step; a fast job makes several steps meanwhile).
LOCAL_STOP_LATENCY_S = 0.25


def mindspore_cluster_env(world_size: int) -> dict[str, str]:
    """What the agent sets of MindSpore's cluster settings for a generation of ``world_size``
    ranks (an admin's ``pass_env`` or a job's ``env`` that sets them wins)."""
    if world_size > FAST_HEARTBEAT_MAX_WORKERS:
        return {}
    return {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}


class LaunchError(Exception):
    """A generation cannot start here; ``cause`` says whether the spec or the node is at fault."""

    def __init__(self, cause: FailureCause, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def preflight(spec: JobSpec, log_dir: str, msrun: str, user: WorkerUser | None = None,
              allow_env: frozenset[str] = frozenset()) -> None:
    """What msrun would otherwise fail on later, or never report: checked before anything starts.

    The script and the checkpoint directory come from the spec (the same on every node, on shared
    storage): not usable here means not usable at all, so the job fails with the path and the
    error. The log directory and msrun belong to the node."""
    def os_error(e: OSError) -> str:
        return e.strerror or str(e)

    refused = forbidden_env(dict(spec.env), allow_env)
    if refused:
        raise LaunchError(FailureCause.LAUNCH_SPEC, f"env sets {', '.join(refused)}: loader and interpreter variables "
                                                    f"run code in every worker; an admin may allow them (allow_env)")
    if not os.path.isfile(spec.script):
        why = "is a directory" if os.path.isdir(spec.script) else "does not exist"
        raise LaunchError(FailureCause.LAUNCH_SPEC, f"script {spec.script} {why}")
    if not os.access(spec.script, os.R_OK):
        raise LaunchError(FailureCause.LAUNCH_SPEC, f"script {spec.script} is not readable")
    if user is not None and user.switch:
        # Made by the worker user itself, as its own: root creating (and handing over) a path a
        # spec names would let a job choose where it may write (a venv's site-packages...). Then
        # asked of that user whether it may write there (a read-only mount, an ACL, ProtectSystem
        # without ReadWritePaths: the mode bits do not tell).
        as_worker = setpriv(user)
        made = subprocess.run([*as_worker, "mkdir", "-p", "--", spec.checkpoint_dir],
                              capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
        if made.returncode != 0:
            why = (made.stderr.strip().splitlines() or ["mkdir failed"])[-1].split(": ")[-1]
            raise LaunchError(FailureCause.LAUNCH_SPEC, f"checkpoint_dir {spec.checkpoint_dir} cannot be created by "
                                                        f"the worker user {user.name}: {why}")
        probe = subprocess.run([*as_worker, "sh", "-c", 'test -w "$1" && test -x "$1"', "sh", spec.checkpoint_dir],
                               capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
        if probe.returncode != 0:
            raise LaunchError(FailureCause.LAUNCH_SPEC, f"checkpoint_dir {spec.checkpoint_dir} is not writable by the "
                                                        f"worker user {user.name} (uid {user.uid})")
    else:
        try:
            os.makedirs(spec.checkpoint_dir, exist_ok=True)
        except OSError as e:
            raise LaunchError(FailureCause.LAUNCH_SPEC,
                              f"checkpoint_dir {spec.checkpoint_dir} cannot be created: {os_error(e)}") from None
        if not os.access(spec.checkpoint_dir, os.W_OK | os.X_OK):
            raise LaunchError(FailureCause.LAUNCH_SPEC, f"checkpoint_dir {spec.checkpoint_dir} is not writable")
    try:
        os.makedirs(log_dir, exist_ok=True)
        # msrun's own log, made by root before the folder is handed over (its fd is inherited).
        os.close(os.open(os.path.join(log_dir, "msrun.log"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o640))
        if user is not None and user.switch:
            os.chown(log_dir, user.uid, user.gid)  # msrun and the workers write their logs there
            parent = os.path.dirname(log_dir)
            for d in (parent, os.path.dirname(parent), os.path.dirname(os.path.dirname(parent))):
                os.chmod(d, os.stat(d).st_mode | 0o001)  # the worker user may pass (not list): work_dir/logs/<job>
    except OSError as e:
        raise LaunchError(FailureCause.LAUNCH_NODE, f"log directory {log_dir} cannot be created: {os_error(e)}") \
            from None
    if not os.access(msrun, os.X_OK):
        raise LaunchError(FailureCause.LAUNCH_NODE, f"msrun not found at {msrun}")


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


async def remove_snapshot_folder(path: str, user: WorkerUser | None) -> None:
    """Remove a job's snapshot folder, off the event loop: its content as the worker user (it owns
    the folder, mode 0700; elasticd has no CAP_DAC_OVERRIDE under the unit), then the folder
    itself from elasticd's own. Errors are logged, never raised."""
    try:
        if user is not None and user.switch:
            proc = await asyncio.create_subprocess_exec(
                *setpriv(user), "find", path, "-xdev", "-mindepth", "1", "-delete", env={"PATH": "/usr/bin:/bin"},
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(proc.communicate(), 300)
            if proc.returncode:
                raise OSError(err.decode(errors="replace").strip()[-300:] or f"find exited {proc.returncode}")
            await asyncio.to_thread(os.rmdir, path)
        else:
            await asyncio.to_thread(shutil.rmtree, path)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - memory left behind is logged, never a crash
        log.warning("snapshot folder %s not removed: %s", path, e)


async def sweep_snapshot_folders(root: str, user: WorkerUser | None, keep: set[str]) -> None:
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
            await remove_snapshot_folder(os.path.join(root, name), user)


def _write_and_close(fd: int, data: bytes) -> None:
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:  # the child died before reading (EPIPE): its exit is the failure reported
        pass


# Under SCHED_BATCH (``batch_scheduling``) a woken thread does not preempt a running one: MindSpore
# 2.10's TCP client marks a connection "connecting" after handing it to its event loop, whose
# thread, woken at once on loopback, otherwise preempts it and has its "connected" overwritten (a
# registration failed and retried 0.5 s later; the trainer library also runs init() on one core:
# mselastic.trainer.context._unraced). The measurements: docs/journal/2026-12.md, "... SCHED_BATCH".
async def spawn_as_worker(cmd: list[str], env: dict[str, str], job_env: dict[str, str], user: WorkerUser | None,
                          cwd: str, *, batch: bool = True, **io: Any) -> asyncio.subprocess.Process:
    """Start ``cmd`` as the worker user, in a session of its own, dying with elasticd (msrun, a
    standby). ``job_env`` (the job spec's variables) is added after the user switch: it reaches the
    process through a pipe that ``mselastic.agent.envexec`` reads, so nothing runs as root with it
    (``LD_PRELOAD``, if an admin allows it), it is never on disk, and elasticd needs no right to write
    in the worker user's folders. ``batch``: under the ``SCHED_BATCH`` policy, inherited by every
    process and thread it starts (see above). ``io``: stdin, stdout, stderr as for asyncio's
    subprocesses. Raises OSError or RuntimeError when it cannot be started."""
    if batch:
        cmd = [*batch_prefix(), *cmd]
    who = user if user is not None and user.switch else None
    env_r = env_w = -1
    if who is not None:
        env_r, env_w = os.pipe()
        cmd = [sys.executable, "-m", "mselastic.agent.envexec", str(env_r), "--", *cmd]
    else:
        env = {**env, **job_env}
    started = False
    try:
        proc = await asyncio.create_subprocess_exec(
            *with_parent_death(cmd, (who.uid, who.gid) if who else None), env=env, cwd=cwd, start_new_session=True,
            pass_fds=(env_r,) if who else (), **io)
        started = True
    finally:
        if env_r >= 0:
            os.close(env_r)
        if env_w >= 0 and not started:
            os.close(env_w)
    if env_w >= 0:
        # A daemon thread of its own, not awaited: a job env larger than the pipe waits for envexec
        # to read it, and one that never reads (stopped, killed) must hold nothing up; its end of
        # the pipe closing ends the write.
        threading.Thread(target=_write_and_close, args=(env_w, json.dumps(job_env).encode()),
                         name=f"env-{proc.pid}", daemon=True).start()
    return proc


def scheduler_host(addr: str) -> str:
    """``master_addr`` as msrun gives it to its processes (``MS_SCHED_HOST``): an IP address, a host
    name resolved (``_convert_addr_to_ip`` in msrun's ``process_entity/_utils.py``)."""
    plain = addr.strip().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(plain))
    except ValueError:
        return str(socket.getaddrinfo(plain, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0])


#: How long the workers of a warm launch wait for its scheduler to listen before they are handed
#: over anyway (they retry connecting; ``startup_timeout_s`` bounds the launch).
SCHEDULER_LISTEN_S = 2.0
#: How long the workers of a warm launch on another node wait for node 0's scheduler to be
#: reachable before they are handed over anyway (node 0 may still be stopping the previous
#: generation, or start this one cold).
SCHEDULER_REACH_S = 10.0
#: The launcher of the cold path: the msrun of elasticd's own environment.
MSRUN = os.path.join(os.path.dirname(sys.executable), "msrun")


def _open_own(path: str) -> Any:
    """``path`` (msrun.log, which preflight made as root in the folder it then hands to the worker
    user) opened for appending, only as the file root made: never through a symlink or a hard link
    a job planted there since (root would append to a file of the job's choosing)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise RuntimeError(f"{path} is not the log file elasticd made (replaced since)")
    return os.fdopen(fd, "ab")


def _tcp_states(port: int) -> list[str] | None:
    """The states of this network namespace's TCP sockets whose local port is ``port``, from the
    kernel's tables (``/proc/net/tcp``, ``tcp6``; 0A: listening, 01: established); None when
    neither table could be read. Not psutil's net_connections, which also maps every socket to its
    process by reading every process's file descriptors (which the hardened unit may not)."""
    suffix = f":{port:04X}"
    states: list[str] = []
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                states += [fields[3] for line in f if len(fields := line.split()) > 3 and fields[1].endswith(suffix)]
            read = True
        except OSError:
            continue
    return states if read else None


def _listens(port: int) -> bool:
    """Whether a TCP socket of this network namespace listens on ``port``."""
    return "0A" in (_tcp_states(port) or [])


def _connected(port: int) -> bool:
    """Whether anything is still connected to what listens on ``port`` here (an established TCP
    connection: a peer that exited has closed its end). Unknown (the tables unreadable) counts as
    connected: the generation then ends when msrun does."""
    states = _tcp_states(port)
    return states is None or "01" in states


async def _listening(port: int, proc: Proc, within_s: float) -> bool:
    """Wait until something on this node listens on TCP ``port`` (``proc``, a scheduler just handed
    its generation), at most ``within_s`` and while ``proc`` runs; nothing connects to it to find out."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.returncode is None:  # (killed by a stop: returns)
        if await asyncio.to_thread(_listens, port):  # (the tables can be long: off the event loop)
            return True
        await asyncio.sleep(0.01)
    return False


class _stop_when(tenacity.stop.stop_base):
    """tenacity's stop condition: ``done()`` says so (a generation stopped meanwhile)."""

    def __init__(self, done: Callable[[], bool]) -> None:
        self.done = done

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.done()


async def _reachable(host: str, port: int, within_s: float, stopping: Callable[[], bool]) -> bool:
    """Wait until a TCP connection to ``host:port`` (node 0's scheduler) opens, at most
    ``within_s`` and while ``stopping()`` is false. The connection is closed at once, with
    nothing sent: MindSpore's scheduler drops it and goes on (a probe connecting five times
    before a plain msrun job's workers did: the job ran as without it)."""
    async def connect() -> None:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    try:
        await tenacity.AsyncRetrying(
            stop=tenacity.stop_after_delay(within_s) | _stop_when(stopping),
            wait=tenacity.wait_random(0.02, 0.1), reraise=True,
            retry=tenacity.retry_if_exception_type((OSError, asyncio.TimeoutError)))(connect)
        return True
    except (OSError, asyncio.TimeoutError):
        return False


#: What a standby gets only at its handover: the generation's own values (and HOME, the
#: generation's log folder for a switched user). Everything else of the generation's environment is
#: the job's, the same for every generation, and a standby starts with it.
PER_GENERATION_ENV = frozenset({
    contract.ENV_GENERATION, contract.ENV_RESTART_COUNT, contract.ENV_HEARTBEAT, contract.ENV_RUN_ID,
    contract.ENV_STOP_FILE, "HOME", "MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER"})


class Generation:
    """One plan's launch on this node: msrun, its scheduler and the local ranks (or standbys that
    became them: see :meth:`_hand_over`)."""

    def __init__(self, plan: Plan, spec: JobSpec, node_id: str, work_dir: str,
                 on_change: Callable[["Generation", bool], None], poll_interval_s: float = 0.1,
                 user: WorkerUser | None = None, allow_env: frozenset[str] = frozenset(),
                 pass_env: frozenset[str] = frozenset(), standbys: list[Standby] | None = None,
                 snapshot_root: str = "", batch_scheduling: bool = True) -> None:
        member = plan.member(node_id)
        if member is None:
            raise ValueError(f"node {node_id} is not a member of generation {plan.generation}")
        self.plan, self.spec, self.node_id, self.member = plan, spec, node_id, member
        self.first_rank = plan.first_rank(node_id)
        self.log_dir = os.path.join(work_dir, "logs", spec.name, f"g{plan.generation:06d}")
        #: The planned stop's step, for the ranks: beside the log folder, in elasticd's own folder
        #: (the worker user owns the log folder; elasticd has no right to write there under the unit).
        self.stop_file = self.log_dir + ".stop"
        #: The step this generation's ranks were told to stop at (0: none yet).
        self.stop_at = 0
        #: (monotonic time, highest step) when the highest step changed, the last few: the step rate.
        self._progress: collections.deque[tuple[float, int]] = collections.deque(maxlen=32)
        self._asked: set[int] = set()  # ranks that asked for a stop step (logged once each)
        self.run_id = f"{spec.name}.{plan.generation}.{node_id}.{uuid.uuid4().hex[:8]}"
        self.state = GenerationState.STARTING
        self.ranks = {r: RankState(r) for r in range(self.first_rank, self.first_rank + member.local_workers)}
        self._seen: set[int] = set()  # msrun's children already classified
        #: (pid, start time) -> whether its heartbeats count (a descendant of this generation's msrun).
        self._senders: dict[tuple[int, float], bool] = {}
        self._forgers: set[int] = set()  # pids whose heartbeats were dropped (logged once each)
        self.failed_rank = -1
        self.reason = ""
        self.cause = FailureCause.NONE
        self.detected_at = 0.0
        self.stopped_at = 0.0
        self.first_step_at = 0.0
        self.resumed_step = -1
        self.resume_note = ""
        self.exit_step = -1
        self.started_mono = 0.0
        self.done = asyncio.Event()
        self._on_change = on_change
        #: Called once, when a local rank first gets through init() (the agent tells the other nodes).
        self.on_joined: Callable[["Generation"], None] = lambda gen: None
        self._remote_joined_at = 0.0
        self._poll_s = poll_interval_s
        #: Set when a watched process has ended (see :meth:`_watch_exits`): the watch looks at once.
        self._wake = asyncio.Event()
        #: What wakes it: msrun's ranks by pid -> pidfd (-1: none could be opened); the processes
        #: elasticd has a handle on (msrun, the warm ranks and scheduler) by pid -> their wait().
        self._exit_fds: dict[int, int] = {}
        self._exit_waits: dict[int, asyncio.Future[int]] = {}
        self._msrun: asyncio.subprocess.Process | None = None
        #: Warm: the standbys handed this generation (the scheduler's first on node_rank 0), and the
        #: rank each worker became. Cold: msrun starts them.
        self.standbys = list(standbys or [])
        self._warm_ranks: dict[int, Standby] = {}
        #: msrun.log, opened by root before anything of the generation runs (see :func:`_open_own`).
        self._log: Any = None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._ctx = dict(job=spec.name, generation=plan.generation, node=node_id)
        #: Who the workers run as (None: as elasticd itself), and the env names the admin allows.
        self.user = user
        self.allow_env = allow_env
        self.pass_env = pass_env
        #: Where this node keeps the job's snapshots ("": none; made by :meth:`prepare_snapshots`).
        self.snapshot_root = snapshot_root if spec.snapshot_interval_steps else ""
        self.batch_scheduling = batch_scheduling
        self.snapshot_dir = ""

    # -- lifecycle ---------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """A stop of this generation was asked for (planned or not)."""
        return self._stopping

    def prepare_snapshots(self) -> None:
        """Make the job's snapshot folder here (before the standbys are matched: the folder is in
        the launch's environment). One that cannot be made safely means no snapshots here."""
        if not self.snapshot_root:
            return
        try:
            self.snapshot_dir = snapshot_folder(self.snapshot_root, self.spec.name, self.user)
        except OSError as e:  # the checkpoints still stand: train without snapshots here
            log.warning("no snapshots on this node: %s", e, extra=self._ctx)

    async def start(self) -> None:
        """Hand the generation to the standbys it was given (warm), else start msrun (cold). Anything
        that keeps it from starting (see :func:`preflight`, a master port in use on node_rank 0,
        msrun failing to spawn, a standby gone) fails it at once, with the reason."""
        try:
            preflight(self.spec, self.log_dir, MSRUN, self.user, self.allow_env)
        except LaunchError as e:
            await self._fail(-1, str(e), e.cause)
            return
        with contextlib.suppress(FileNotFoundError):  # a step left by an elasticd that died in a stop
            os.unlink(self.stop_file)
        p = self.plan
        if self.member.node_rank == 0 and not _port_free(p.master_port):
            # A live scheduler of another job or generation there would capture our workers.
            await self._fail(-1, f"master port {p.master_port} is in use on node {self.node_id}",
                             FailureCause.LAUNCH_NODE)
            return
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The kernel attaches each sender's pid/uid/gid (SCM_CREDENTIALS): any local user can reach
        # an abstract socket, so a beat counts only from a process of this generation.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind("\0mselastic-hb-" + self.run_id)
        self._sock.setblocking(False)
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._read_beats)
        if self.standbys and not all(sb.alive for sb in self.standbys):
            # One died since it was taken (the OOM killer, a signal): cold, rather than blame the node.
            log.warning("a standby worker exited before its handover; starting cold", extra=self._ctx)
            await asyncio.gather(*(sb.kill() for sb in self.standbys))
            self.standbys = []
        try:
            self._log = _open_own(os.path.join(self.log_dir, "msrun.log"))
            if not self.standbys:
                await self._start_msrun(MSRUN)
        except (OSError, RuntimeError) as e:
            await self._fail(-1, f"msrun could not be started: {e}", FailureCause.LAUNCH_NODE)
            return
        self.started_mono = time.monotonic()
        # The handover waits for the scheduler to listen: in the watcher's task, not in the Launch
        # call (whose deadline would cancel it halfway).
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.run_id}")

    async def _run(self) -> None:
        if any(not sb.ready_at for sb in self.standbys) and not await self._standbys_ready():
            return
        if self.standbys and self.member.node_rank != 0 and not await self._scheduler_reached():
            return
        if self.standbys:
            try:
                await self._hand_over()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug here must not leave the generation unwatched either
                if self._stopping:
                    return  # stopped meanwhile (its standbys killed under the handover): not a launch failure
                known = isinstance(e, (OSError, RuntimeError, asyncio.TimeoutError, psutil.Error))
                if not known:
                    log.exception("handover failed", extra=self._ctx)
                await self._fail(-1, f"the standby workers could not take over: {e}",
                                 FailureCause.LAUNCH_NODE if known else FailureCause.SUPERVISOR_ERROR)
                return
        if not self._stopping:
            await self._watch()

    async def _standbys_ready(self) -> bool:
        """Standbys taken while still importing: wait for them, as for a cold start's ranks, within
        startup_timeout_s. One that exits first (the OOM killer) or is not ready in time sends the
        generation cold, as one found dead when taken does, rather than blame the node. False when
        the generation was stopped meanwhile or could not start."""
        importing = [sb for sb in self.standbys if not sb.ready_at]
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(sb.until_ready(self.spec.startup_timeout_s) for sb in importing))
        except RuntimeError as e:
            return not self._stopping and await self._cold_instead(str(e))
        log.info("waited %.1fs for standbys %s to finish importing", time.monotonic() - t0,
                 [sb.pid for sb in importing], extra=self._ctx)
        return not self._stopping

    async def _scheduler_reached(self) -> bool:
        """On a node other than node_rank 0: wait until node 0's scheduler can be reached (node 0
        may still be stopping the previous generation; a worker MindSpore's scheduler refuses
        retries only half a second later), ``SCHEDULER_REACH_S`` at most, then hand over anyway.
        A standby that died meanwhile sends the generation cold. False when the generation was
        stopped meanwhile or could not start."""
        host, port = scheduler_host(self.plan.master_addr), self.plan.master_port
        if not await _reachable(host, port, SCHEDULER_REACH_S, lambda: self._stopping) and not self._stopping:
            log.warning("the scheduler at %s:%d was not reachable within %.0fs; the workers are handed over "
                        "and retry on their own", host, port, SCHEDULER_REACH_S, extra=self._ctx)
        if self._stopping:
            return False
        if not all(sb.alive for sb in self.standbys):
            return await self._cold_instead("a standby worker exited while waiting for the scheduler")
        return True

    async def _cold_instead(self, why: str) -> bool:
        """Start the generation under msrun after all, its standbys killed, rather than blame the
        node. False when msrun could not be started or the generation was stopped meanwhile."""
        log.warning("%s; starting cold", why, extra=self._ctx)
        standbys, self.standbys = self.standbys, []
        await asyncio.gather(*(sb.kill() for sb in standbys))
        try:
            await self._start_msrun(MSRUN)
        except (OSError, RuntimeError) as err:
            await self._fail(-1, f"msrun could not be started: {err}", FailureCause.LAUNCH_NODE)
            return False
        if self._stopping:  # stopped while msrun was being started: it may not have been seen
            await procs.stop_generation(self._markers(), self._live_launched(), grace_s=0)
            return False
        self.started_mono = time.monotonic()
        return True

    async def _start_msrun(self, msrun: str) -> None:
        """The cold path: msrun starts the scheduler (on node_rank 0) and the local ranks."""
        p = self.plan
        cmd = [msrun,
               f"--worker_num={p.world_size}", f"--local_worker_num={self.member.local_workers}",
               f"--master_addr={p.master_addr}", f"--master_port={p.master_port}",
               f"--node_rank={self.member.node_rank}", f"--log_dir={self.log_dir}",
               "--join=True", "--tail_worker_log=99999",
               f"--cluster_time_out={int(self.spec.startup_timeout_s)}",
               self.spec.script, *self.spec.args]
        assert self._log is not None
        self._msrun = await spawn_as_worker(cmd, self._env(), self._job_env(), self.user, self.cwd,
                                            batch=self.batch_scheduling, stdin=asyncio.subprocess.DEVNULL,
                                            stdout=self._log, stderr=asyncio.subprocess.STDOUT)
        log.info("generation launched: msrun pid %d, master %s:%d, ranks %d..%d, logs %s",
                 self._msrun.pid, p.master_addr, p.master_port, self.first_rank,
                 self.first_rank + self.member.local_workers - 1, self.log_dir, extra=self._ctx)

    async def _hand_over(self) -> None:
        """The warm path: the standbys become the processes msrun would have started, with msrun's
        environment (``process_entity/_api.py``: ``MS_WORKER_NUM``, ``MS_SCHED_HOST``, ``MS_SCHED_PORT``,
        ``MS_TOPO_TIMEOUT``, ``RANK_SIZE``; the scheduler ``MS_ROLE=MS_SCHED`` and ``RANK_ID=0``; each
        worker ``MS_ROLE=MS_WORKER``, ``RANK_ID``/``MS_NODE_ID`` its global rank, ``DEVICE_ID`` its local
        index), its log files, arguments and working directory. The scheduler (node_rank 0: the node
        whose address is master_addr) goes first and the workers once it listens, all of them at once:
        workers that meet no scheduler retry only half a second later (on the other nodes they are
        handed over once it can be reached: ``_scheduler_reached``). The ranks' start-up timeout
        counts from the handover, as a cold rank's from msrun's start."""
        p = self.plan
        env = {**self._env(), **self._job_env()}  # as msrun's environment is (the job's env applied last)
        common = {"MS_WORKER_NUM": str(p.world_size), "MS_SCHED_HOST": scheduler_host(p.master_addr),
                  "MS_SCHED_PORT": str(p.master_port), "MS_TOPO_TIMEOUT": str(int(self.spec.startup_timeout_s)),
                  "RANK_SIZE": str(p.world_size)}
        argv = [self.spec.script, *self.spec.args]
        standbys = list(self.standbys)
        lines = []
        if self.member.node_rank == 0:
            scheduler = standbys.pop(0)
            path = os.path.join(self.log_dir, "scheduler.log")
            await scheduler.hand_over({**env, **common, "MS_ROLE": "MS_SCHED", "RANK_ID": "0"}, argv, self.cwd, path)
            lines.append(f"Start scheduler process (warm: standby pid {scheduler.pid}), log file:{path}.")
            # The workers go once it listens (a worker that meets no scheduler retries only half a
            # second later), or after a while anyway: they retry, and startup_timeout_s bounds it all.
            await _listening(p.master_port, scheduler.proc, within_s=SCHEDULER_LISTEN_S)
            if scheduler.proc.returncode is not None:
                raise RuntimeError(f"the scheduler (standby pid {scheduler.pid}) exited with code "
                                   f"{scheduler.proc.returncode}; see {path}")
        for i, (rs, standby) in enumerate(zip(self.ranks.values(), standbys)):
            if self._stopping:
                return
            path = os.path.join(self.log_dir, f"worker_{rs.rank}.log")
            await standby.hand_over({**env, **common, "MS_NODE_ID": str(rs.rank), "MS_ROLE": "MS_WORKER",
                                     "RANK_ID": str(rs.rank), "DEVICE_ID": str(i)}, argv, self.cwd, path)
            rs.pid, rs.create_time = standby.pid, psutil.Process(standby.pid).create_time()
            self._warm_ranks[rs.rank] = standby
            lines.append(f"Start worker process with rank id:{rs.rank} (warm: standby pid {standby.pid}), "
                         f"log file:{path}.")
        if self._log is not None:  # (closed: stopped meanwhile)
            self._log.write("".join(line + "\n" for line in lines).encode())  # what msrun would have said
            self._log.flush()
        self.started_mono = time.monotonic()
        log.info("generation launched warm: standbys %s, master %s:%d, ranks %d..%d, logs %s",
                 [sb.pid for sb in self.standbys], p.master_addr, p.master_port, self.first_rank,
                 self.first_rank + self.member.local_workers - 1, self.log_dir, extra=self._ctx)

    @property
    def cwd(self) -> str:
        """msrun's and the ranks' working directory: the script's folder."""
        return os.path.dirname(self.spec.script)

    def standby_env(self, marker: str) -> dict[str, str]:
        """The environment a standby for this job starts with: the generation's without its own
        values (:data:`PER_GENERATION_ENV`: they come with the handover), its marker, and the slot
        the handover writes the generation's variables into (see ``mselastic.trainer.standby``).
        The marker and the slot stay last, and adjacent."""
        base = self._env()
        env = {k: v for k, v in base.items() if k not in PER_GENERATION_ENV}
        if "HOME" in base:  # (a switched user's: the job's log folder until its handover)
            env["HOME"] = os.path.dirname(self.log_dir)
        env[contract.ENV_RUN_ID] = marker
        env[contract.ENV_STANDBY_SLOT] = "x" * contract.STANDBY_SLOT_BYTES
        return env

    async def spawn_standby(self, marker: str, fd: int) -> asyncio.subprocess.Process:
        """Start a standby worker for this job (see ``mselastic.trainer.standby``): as the worker user,
        with the job's environment and ``marker``, in the script's folder; ``fd`` (its end of a
        socket pair) as its standard input, output and error."""
        return await spawn_as_worker([sys.executable, "-m", "mselastic.trainer.standby"], self.standby_env(marker),
                                     self._job_env(), self.user, self.cwd, batch=self.batch_scheduling,
                                     stdin=fd, stdout=fd, stderr=fd)

    def launch_key(self) -> str:
        """What a standby was started with that a generation could change: equal keys, equal starts."""
        env = {k: v for k, v in self._env().items() if k not in PER_GENERATION_ENV}
        what = [self.spec.script, list(self.spec.args), self.cwd, self.user.uid if self.user else os.geteuid(),
                sorted(env.items()), sorted(self._job_env().items())]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]

    def _launched(self) -> list[Proc]:
        """The processes elasticd started for this generation: msrun, or the standbys it took over."""
        return [self._msrun] if self._msrun is not None else [sb.proc for sb in self.standbys]

    def _markers(self) -> set[str]:
        """Every marker a process of this generation carries in its environment (a standby's own
        is there too, were its handover's rewrite of the kernel's copy not to have happened)."""
        return {self.run_id} | {sb.marker for sb in self.standbys}

    def _live_launched(self) -> list[psutil.Process]:
        live = []
        for proc in self._launched():
            if proc.returncode is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    live.append(psutil.Process(proc.pid))
        return live

    def _warm_scheduler(self) -> Standby | None:
        """The standby that became this generation's scheduler (warm, node_rank 0), once handed over."""
        if self.member.node_rank != 0 or not self._warm_ranks:
            return None
        return self.standbys[0]

    def _launch_exit_code(self) -> int | None:
        """msrun's exit code; warm: once every rank has exited, theirs (the first that is not 0);
        None while they run."""
        if self._msrun is not None:
            return self._msrun.returncode
        codes = [sb.proc.returncode for sb in self._warm_ranks.values()]
        if not codes or any(c is None for c in codes):
            return None
        return next((c for c in codes if c), 0)

    def _env(self) -> dict[str, str]:
        # Built, not inherited: the daemon's environment may hold what a job must not see (see
        # mselastic.agent.users), and a job's env may not set loader or interpreter variables.
        env = inherited_env(os.environ, self.pass_env)
        if self.user is not None and self.user.switch:
            env.update(HOME=self.log_dir, USER=self.user.name, LOGNAME=self.user.name)
        else:
            env.update(self._job_env())  # (switching: added after the switch, see start)
        venv_bin = os.path.dirname(sys.executable)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        env.update({
            contract.ENV_JOB: self.spec.name,
            contract.ENV_GENERATION: str(self.plan.generation),
            contract.ENV_RESTART_COUNT: str(self.plan.restart_count),
            contract.ENV_NODE_ID: self.node_id,
            contract.ENV_CHECKPOINT_DIR: self.spec.checkpoint_dir,
            contract.ENV_CHECKPOINT_INTERVAL: str(self.spec.checkpoint_interval_steps),
            contract.ENV_KEEP_CHECKPOINTS: str(self.spec.keep_checkpoints),
            contract.ENV_STOP_CHECK_INTERVAL: str(self.spec.stop_check_interval_steps),
            contract.ENV_TOTAL_STEPS: str(self.spec.total_steps),
            contract.ENV_GLOBAL_BATCH: str(self.spec.global_batch_size),
            contract.ENV_MICRO_BATCHES: ",".join(map(str, self.spec.micro_batch_sizes)),
            contract.ENV_HEARTBEAT: "mselastic-hb-" + self.run_id,
            contract.ENV_RUN_ID: self.run_id,
            contract.ENV_STOP_FILE: self.stop_file,
        })
        if self.batch_scheduling:
            env[contract.ENV_BATCH_START] = "1"
        if self.snapshot_dir:
            env[contract.ENV_SNAPSHOT_DIR] = self.snapshot_dir
            env[contract.ENV_SNAPSHOT_INTERVAL] = str(self.spec.snapshot_interval_steps)
        for name, value in mindspore_cluster_env(self.plan.world_size).items():
            env.setdefault(name, value)
        return env

    def _job_env(self) -> dict[str, str]:
        """The job's env, without what it may not set (preflight refused a launch that sets any)."""
        refused = forbidden_env(dict(self.spec.env), self.allow_env)
        return {k: v for k, v in self.spec.env.items() if k not in refused}

    async def stop(self, grace_s: float, stop_at: int = 0, reason: str = "", now: bool = False) -> list[int]:
        """Stop every process of this generation. Returns leftovers. ``reason``: why, for the
        report (else what the ranks' exits say). ``now``: kill at once, even ranks already
        leaving and beside a planned stop under way (a fence must end within fencing.KILL_S).

        With ``grace_s`` > 0 (a planned stop) the ranks alone get SIGTERM first, after the step
        they stop at is in the stop file: ``stop_at``, which the coordinator chose for every
        member, or one this agent chooses when every rank is its own (else none: the ranks agree
        at their backstop). They checkpoint there and exit with the planned-exit code. msrun
        itself must not get it (it has no handler and dies; its workers die with it, unsaved).
        Whatever is left after the grace period is killed; with no step named it counts from
        the backstop step the ranks can next agree at (at the measured step rate).
        """
        self._stopping = True
        if now:
            grace_s = 0
        if grace_s > 0 and not self.state.terminal:
            if not self.stop_at:  # told once: a Stop sent again must not move it
                if stop_at <= 0 and len(self.plan.members) == 1:
                    stop_at = self.next_stop_step()
                if stop_at > 0:
                    self.plan_stop(stop_at)
            rate = self.steps_per_s()
            if not self.stop_at and rate > 0:
                grace_s += self.spec.stop_check_interval_steps / rate
            await self._ask_ranks_to_stop(grace_s)
        elif not now and not self.state.terminal and any(rs.exit_step >= 0 for rs in self.ranks.values()):
            await self._wait_ranks_gone(min(self.spec.stop_grace_period_s, 2.0))  # they are leaving already
        left = await procs.stop_generation(self._markers(), self._live_launched(), grace_s=0)
        for proc in self._launched():
            try:
                await asyncio.wait_for(proc.wait(), timeout=5)
            except asyncio.TimeoutError:
                left.append(proc.pid)
        self.stopped_at = self.stopped_at or time.time()
        if not self.state.terminal:
            self._drain_beats()
            self.exit_step = self._exit_step()
            self._set(GenerationState.STOPPED, reason=reason or (self._exit_reason(asked=grace_s > 0)
                      if self.exit_step >= 0 else "stopped on request"))
        self._close()
        if left:
            log.error("processes left after stop: %s", left, extra=self._ctx)
        return left

    def steps_per_s(self) -> float:
        """The highest local rank's step rate over its last few steps (0.0 before two steps)."""
        if len(self._progress) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._progress[0], self._progress[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def next_stop_step(self) -> int:
        """The step a stop this agent makes names (every rank is its own), from the beats read up
        to now and the steps made in ``LOCAL_STOP_LATENCY_S``; 0 while a rank's step is unknown."""
        self._drain_beats()
        return contract.stop_step_ahead([rs.step for rs in self.ranks.values()], self.steps_per_s(),
                                        LOCAL_STOP_LATENCY_S)

    def plan_stop(self, step: int) -> None:
        """Write the step the ranks stop at where they read it once signalled (atomically: a
        temporary file of elasticd's own folder renamed over it). Once only: a step some ranks may
        have read is never moved. When it cannot be written the ranks agree at their backstop."""
        if self.stop_at:
            return
        tmp = f"{self.stop_file}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                os.fchmod(fd, 0o644)  # the worker user reads it, whatever the umask
                os.write(fd, contract.encode_stop_step(step))
            finally:
                os.close(fd)
            os.replace(tmp, self.stop_file)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.error("stop step %d not written to %s (%s): the ranks agree at their backstop", step,
                      self.stop_file, e.strerror or e, extra=self._ctx)
            return
        self.stop_at = step
        top = max(rs.step for rs in self.ranks.values())
        if top >= step:
            log.warning("stop step %d is not ahead of rank step %d: a rank already past it cannot stop there",
                        step, top, extra=self._ctx)
        else:
            log.info("the ranks stop at step %d (highest step now %d)", step, top, extra=self._ctx)

    async def _ask_ranks_to_stop(self, grace_s: float) -> None:
        self._signal_ranks()
        slow = await self._wait_ranks_gone(grace_s)
        if slow:
            log.warning("ranks %s did not exit within %.0fs of SIGTERM; killing", slow, grace_s, extra=self._ctx)

    def _signal_ranks(self) -> None:
        """SIGCONT (a stopped rank ignores SIGTERM) and SIGTERM to every live local rank."""
        self._discover()
        ranks = [rs for rs in self.ranks.values() if rs.pid and procs.alive(rs.pid, rs.create_time)]
        for rs in ranks:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.kill(rs.pid, sig)
                except ProcessLookupError:
                    pass
        log.info("asked ranks %s to checkpoint and exit%s", [r.rank for r in ranks],
                 f" at step {self.stop_at}" if self.stop_at else "", extra=self._ctx)

    async def _wait_ranks_gone(self, timeout_s: float) -> list[int]:
        """Wait for the ranks to exit, noting their exit codes; returns the ranks still running."""
        ranks = [rs for rs in self.ranks.values() if rs.pid]
        deadline = time.monotonic() + timeout_s
        while any(procs.alive(rs.pid, rs.create_time) for rs in ranks) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # msrun reaps within a second: look often to see the exit codes
            self._note_exit_codes()
        self._note_exit_codes()
        return [rs.rank for rs in ranks if procs.alive(rs.pid, rs.create_time)]

    def _note_exit_codes(self) -> None:
        for rs in self.ranks.values():
            if rs.pid and rs.exit_code is None:
                # A warm rank is its fork server's child: the server reaps it and says how it ended
                # (its code counts once the kernel says it has ended; until then it is a zombie too).
                standby = self._warm_ranks.get(rs.rank)
                code = standby.proc.returncode if standby is not None else None
                rs.exit_code = code if code is not None else procs.exit_status(rs.pid, rs.create_time)

    def _exit_codes(self) -> str:
        """The ranks' exit codes as seen, for a report's reason."""
        codes = sorted({rs.exit_code for rs in self.ranks.values() if rs.exit_code is not None})
        if codes:
            return f"exited with code {', '.join(map(str, codes))}"
        return f"exited (announced code {contract.PLANNED_EXIT_CODE}; reaped by msrun before the agent saw it)"

    def _exit_reason(self, asked: bool) -> str:
        why = "on request" if asked else "on a SIGTERM not sent by the agent"
        return f"ranks checkpointed at step {self.exit_step} {why} and {self._exit_codes()}"

    def _drain_beats(self) -> None:
        """Read heartbeats still queued: a rank's planned-exit beat can arrive just before it is gone,
        and no await may have let the socket's reader run since."""
        if self._sock is not None:
            self._read_beats()

    def _exit_step(self) -> int:
        """The step every local rank checkpointed at before its planned exit; -1 if they did not all."""
        steps = {rs.exit_step for rs in self.ranks.values()}
        return steps.pop() if len(steps) == 1 and -1 not in steps else -1

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.stop_file)
        if self._log is not None:
            self._log.close()
            self._log = None
        for standby in self.standbys:  # (their end of the socket pair is gone since their handover)
            standby.writer.close()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for fd in self._exit_fds.values():
            if fd >= 0:
                asyncio.get_running_loop().remove_reader(fd)
                os.close(fd)
        for waiting in self._exit_waits.values():
            waiting.cancel()
        self._exit_fds, self._exit_waits = {}, {}
        self.done.set()

    # -- watching ----------------------------------------------------------

    def _read_beats(self) -> None:
        assert self._sock is not None
        for _ in range(MAX_BEATS_PER_READ):  # a flood must not hold the event loop (lease renewals)
            try:
                data, ancillary, _, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(_CREDS.size))
            except BlockingIOError:
                return
            except OSError:
                return
            sender = _sender_pid(ancillary)
            if not self._ours(sender):
                metrics.FORGED_BEATS.inc()
                if sender not in self._forgers:
                    self._forgers.add(sender)
                    log.warning("heartbeat from pid %d, not a process of this generation: dropped", sender,
                                extra=self._ctx)
                continue
            try:
                beat = Beat.decode(data)
            except ValueError:
                log.warning("malformed heartbeat dropped", extra=self._ctx)
                continue
            rs = self.ranks.get(beat.rank)
            if beat.pid != sender or (rs is not None and rs.pid and rs.pid != sender):
                metrics.FORGED_BEATS.inc()
                log.warning("heartbeat for rank %d claiming pid %d sent by pid %d: dropped", beat.rank, beat.pid,
                            sender, extra=self._ctx)
                continue
            if rs is not None and not rs.pid:
                self._learn_pid(rs, sender)
            self._on_beat(beat)

    def _learn_pid(self, rs: RankState, pid: int) -> None:
        """A rank's pid from its own heartbeat (the kernel names the sender) when it is one of msrun's
        own children: :meth:`_discover` may not have classified it yet, and a rank whose pid is
        unknown could not be seen to die."""
        if self._msrun is None:
            return
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            d = procs.describe(p) if p.ppid() == self._msrun.pid else None
            if d is not None and d.role == "MS_WORKER" and d.rank == rs.rank:  # (as _discover checks)
                rs.pid, rs.create_time = pid, d.create_time
                self._seen.add(pid)

    def _ours(self, pid: int) -> bool:
        """The sender is a process of this generation: a descendant of our msrun (its ranks and
        their own children). Not the run id in its environment: that id is public (it is the
        socket's name, listed in /proc/net/unix), any process can carry it. Remembered per
        (pid, start time), the answer either way, so a reused pid is looked at again."""
        roots = {proc.pid for proc in self._launched()}
        if pid <= 0 or not roots:
            return False
        if any(rs.pid == pid for rs in self.ranks.values()):  # a rank found among msrun's children
            return True
        try:
            proc = psutil.Process(pid)
            key = (pid, proc.create_time())
            if key not in self._senders:
                self._senders[key] = pid in roots or any(p.pid in roots for p in proc.parents())
            return self._senders[key]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            # A rank's last beat (planned_exit) is read after it exited: known senders still count.
            return any(ok and key[0] == pid for key, ok in self._senders.items())

    def _on_beat(self, beat: Beat) -> None:
        rs = self.ranks.get(beat.rank)
        if rs is None or beat.generation != self.plan.generation:
            log.warning("heartbeat from rank %d of generation %d ignored", beat.rank, beat.generation,
                        extra=self._ctx)
            return
        joined = any(_JOINED in r.phase_at for r in self.ranks.values())
        if beat.kind == BeatKind.PHASE:  # start-up progress: not a heartbeat (init() may wait long for other nodes)
            if beat.note in Beat.PHASES:
                self._reached(rs, Beat.PHASES.index(beat.note))
        else:
            self._reached(rs, len(Beat.PHASES))  # any other beat comes after the start-up phases
        if not joined and _JOINED in rs.phase_at:
            self.on_joined(self)
        if beat.kind == BeatKind.PHASE:
            return
        rs.last_beat = time.monotonic()
        if beat.step > max(r.step for r in self.ranks.values()):
            self._progress.append((rs.last_beat, beat.step))
        rs.step = max(rs.step, beat.step)
        rs.loss = beat.loss
        if beat.kind == BeatKind.START:
            rs.resumed_step = beat.resumed_step
        if beat.kind == BeatKind.FATAL:
            rs.fatal = beat.note or "no reason given"
            log.error("rank %d cannot go on: %s", beat.rank, rs.fatal, extra={**self._ctx, "rank": beat.rank})
        if beat.kind == BeatKind.START and self.resumed_step < 0:
            self.resumed_step = beat.resumed_step
            if beat.note:
                self.resume_note = beat.note
                log.warning("rank %d: %s", beat.rank, beat.note, extra={**self._ctx, "rank": beat.rank})
        if beat.kind == BeatKind.STEP and not self.first_step_at:
            self.first_step_at = time.time()
            if self.state is GenerationState.STARTING:
                self._set(GenerationState.RUNNING)
                return
        if beat.kind == BeatKind.FINISHED:
            rs.finished = True
        if beat.kind == BeatKind.PLANNED_EXIT:
            rs.exit_step = beat.step
        if beat.kind == BeatKind.STOP_REQUESTED:
            self._stop_requested(beat)
        self._on_change(self, False)

    def _stop_requested(self, beat: Beat) -> None:
        """A rank got a SIGTERM without a stop step: one nobody here sent, or one of ours sent while
        a rank's step was still unknown (loading). When every rank is this node's, choose the step
        and tell them all; across nodes the ranks agree at their backstop (``stop_check_interval_steps``)."""
        if beat.rank not in self._asked:
            self._asked.add(beat.rank)
            log.warning("rank %d got a SIGTERM with no stop step, at step %d", beat.rank, beat.step,
                        extra={**self._ctx, "rank": beat.rank})
        if len(self.plan.members) != 1 or self.stop_at or self.state.terminal:
            return
        if step := self.next_stop_step():  # (it asks again at its next step while a peer's step is unknown)
            self.plan_stop(step)
            self._signal_ranks()

    @staticmethod
    def _reached(rs: RankState, phase: int) -> None:
        now = time.monotonic()
        for p in range(rs.phase + 1, phase + 1):
            rs.phase_at.setdefault(p, now)
        rs.phase = max(rs.phase, phase)

    async def _watch(self) -> None:
        try:
            while not self.state.terminal and not self._stopping:
                self._wake.clear()
                self._discover()
                self._watch_exits()
                self._nudge()
                self._note_exit_codes()
                fault = self._find_fault()
                if fault is not None and self._exited_on_sigterm():
                    await self._stopped_unasked()
                    return
                if fault is not None:
                    # Dead or hung, the collective is broken: kill at once and resume from the last
                    # committed checkpoint. (A SIGTERM to msrun's group here raced msrun's death,
                    # which kills the workers: sometimes they saved, sometimes not.)
                    await self._fail(*fault)
                    return
                if (code := self._launch_exit_code()) is not None:
                    await self._launch_exited(code)
                    return
                if await self._only_the_scheduler_waits():
                    log.info("every rank finished and left the scheduler: the generation is done, "
                             "msrun and its scheduler stopped", extra=self._ctx)
                    await self._launch_exited(0)
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_s):
                        await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not leave workers unwatched
            log.exception("supervisor failed; tearing the generation down", extra=self._ctx)
            await self._fail(-1, "supervisor error", FailureCause.SUPERVISOR_ERROR)

    async def _only_the_scheduler_waits(self) -> bool:
        """Cold, on node_rank 0: every local rank said it finished and exited with code 0, and no
        worker of any node is connected to the scheduler any more (no established connection on
        the master port; each worker holds two while it runs, and a node lost without closing them
        keeps them). msrun then only waits for its scheduler, which sees its workers gone at a
        poll every 5 s (MindSpore's ``meta_server_node`` Finalize): 2.5 s of every job's end on
        average, a node held for nothing. The warm path ends once its ranks have (the scheduler is
        a standby). Otherwise msrun's own exit decides, as before."""
        if self._msrun is None or self.member.node_rank != 0 or not self.ranks:
            return False
        if not all(rs.finished and rs.exit_code == 0 for rs in self.ranks.values()):
            return False
        return not await asyncio.to_thread(_connected, self.plan.master_port)

    def _watch_exits(self) -> None:
        """Wake the watch at once when a process of the generation ends, instead of at its next look
        (up to ``poll_interval_s`` later); the look still decides what happened. msrun, and warm,
        the ranks and the scheduler: when their exit code is known (asyncio's for msrun, the fork
        server's word for a standby), so that the look finds it. msrun's ranks, whose code their
        parent reaps: a pidfd, readable once the rank has exited (a zombie still shows its status).
        Each once, as its pid becomes known."""
        if self.done.is_set():
            return
        handles: list[Any] = [self._msrun, *(sb.proc for sb in self._warm_ranks.values())]
        if (scheduler := self._warm_scheduler()) is not None:
            handles.append(scheduler.proc)
        for proc in handles:
            if proc is not None and proc.pid not in self._exit_waits:
                waiting = asyncio.ensure_future(proc.wait())
                waiting.add_done_callback(lambda _: self._wake.set())
                self._exit_waits[proc.pid] = waiting
        loop = asyncio.get_running_loop()
        for rs in self.ranks.values():
            if not rs.pid or rs.rank in self._warm_ranks or rs.pid in self._exit_fds:
                continue
            try:
                fd = os.pidfd_open(rs.pid)
            except OSError as e:
                self._exit_fds[rs.pid] = -1
                if e.errno != errno.ESRCH:  # (gone already: the look sees it)
                    log.warning("no pidfd for rank %d (pid %d): %s; its exit is seen at the next look",
                                rs.rank, rs.pid, e, extra={**self._ctx, "rank": rs.rank})
                continue
            if not procs.alive(rs.pid, rs.create_time):  # (gone, or another process's pid now: the look sees it)
                os.close(fd)
                self._exit_fds[rs.pid] = -1
                continue
            self._exit_fds[rs.pid] = fd
            loop.add_reader(fd, self._exited, fd)

    def _exited(self, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)  # (readable for good: once is enough)
        self._wake.set()

    def _discover(self) -> None:
        """Learn each local rank's pid from msrun's direct children.

        A child is classified only once it has exec'd the training script: between
        fork and exec its environment is still msrun's own (no ``MS_ROLE``), so it is
        looked at again on the next poll. Descendants of the workers (data loaders)
        carry the same variables and are never taken for a rank.
        """
        if self._msrun is None:
            return  # warm: every rank is known from its handover
        if all(rs.pid for rs in self.ranks.values()):
            return  # (listing msrun's children reads every process's /proc/<pid>/stat: most of a poll)
        try:
            children = psutil.Process(self._msrun.pid).children()
        except psutil.NoSuchProcess:
            return
        for p in children:
            if p.pid in self._seen:
                continue
            d = procs.describe(p)
            if d is None or not d.role:
                continue
            try:
                is_script = self.spec.script in p.cmdline()
            except psutil.NoSuchProcess:
                continue
            self._seen.add(p.pid)
            if d.role == "MS_WORKER" and is_script and d.rank in self.ranks and not self.ranks[d.rank].pid:
                self.ranks[d.rank].pid, self.ranks[d.rank].create_time = d.pid, d.create_time

    def peer_joined(self) -> None:
        """A rank of this generation on another node got through ``init()`` (its agent said so:
        ``Agent.Nudge``): as good as a local peer for :meth:`_nudge`."""
        self._remote_joined_at = self._remote_joined_at or time.monotonic()

    def _nudge(self) -> None:
        """Wake a rank asleep in MindSpore's CPU collective address exchange once a peer got through
        ``init()`` (see ``contract.NUDGE_SIGNAL``): the addresses are all there by then. A local peer,
        or one on another node whose agent told us. Once per rank; a rank whose script does not
        handle the signal ignores it."""
        through = [peer.phase_at[_JOINED] for peer in self.ranks.values() if _JOINED in peer.phase_at]
        through += [self._remote_joined_at] if self._remote_joined_at else []
        if not through or time.monotonic() - min(through) < NUDGE_AFTER_S:
            return
        for rs in self.ranks.values():
            if rs.phase == _JOINED - 1 and not rs.nudged and rs.pid and procs.alive(rs.pid, rs.create_time):
                rs.nudged = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rs.pid, contract.NUDGE_SIGNAL)
                log.info("rank %d still in init() %.2fs after a peer got through: nudged out of MindSpore's "
                         "3 s address poll", rs.rank, time.monotonic() - min(through),
                         extra={**self._ctx, "rank": rs.rank})

    def _find_fault(self) -> tuple[int, str, FailureCause] | None:
        """(rank, reason, cause) of the rank that failed; None while all is well: one look
        (:meth:`_look`), judged by :func:`mselastic.agent.verdict.judge`."""
        fault = verdict.judge(self._look(), verdict.Timing(self.spec.hang_timeout_s, self.spec.startup_timeout_s,
                                                            self.spec.stop_grace_period_s))
        if fault is None:
            return None
        rs = self.ranks.get(fault.rank)
        if fault.cause is FailureCause.RANK_EXITED and rs is not None and rs.exit_code is None:
            rs.exit_code = self._exits_msrun_saw().get(rs.pid)  # (what the report says, as judged)
        return fault.rank, fault.reason, fault.cause

    def _look(self) -> verdict.Look:
        """Look at the ranks once: which are dead (a rank's last beat, finished, a planned exit or
        fatal, comes just before it exits, and its exit wakes the watch at once: the queued beats
        are read and the ranks looked at again), which msrun reaped, how they exited as far as
        known (msrun's log for those it reaped first), which are stopped (state T) and since when."""
        now = time.monotonic()

        def dead() -> set[int]:
            return {rs.rank for rs in self.ranks.values()
                    if not rs.finished and rs.exit_step < 0 and rs.pid and not procs.alive(rs.pid, rs.create_time)}

        gone = dead()
        if gone:
            self._drain_beats()
            gone = dead()
        scheduler = self._warm_scheduler()
        scheduler_exit = scheduler.proc.returncode if scheduler is not None else None
        if scheduler_exit is not None:
            self._drain_beats()  # (a rank's finished beat may be queued)
        saw = self._exits_msrun_saw() if any(self.ranks[r].exit_code is None for r in gone) else {}
        for rs in self.ranks.values():
            stopped = bool(rs.pid) and rs.rank not in gone and procs.stopped(rs.pid, rs.create_time)
            rs.stopped_since = (rs.stopped_since or now) if stopped else 0.0
        return verdict.Look(now=now, started=self.started_mono, scheduler_exit=scheduler_exit,
                            scheduler_pid=scheduler.pid if scheduler is not None else 0, log_dir=self.log_dir,
                            ranks={rs.rank: verdict.RankLook(
                                rank=rs.rank, pid=rs.pid, dead=rs.rank in gone,
                                reaped=rs.rank in gone and self._msrun is not None and procs.gone(rs.pid),
                                exit_code=rs.exit_code if rs.exit_code is not None else saw.get(rs.pid),
                                last_beat=rs.last_beat, finished=rs.finished, exit_step=rs.exit_step, fatal=rs.fatal,
                                stopped_since=rs.stopped_since, phase=rs.phase, phase_at=dict(rs.phase_at))
                                for rs in self.ranks.values()})

    def _exited_on_sigterm(self) -> bool:
        """Every local rank checkpointed on a SIGTERM and has exited (or is exiting)."""
        return all(rs.exit_step >= 0 or rs.finished for rs in self.ranks.values()) and self._exit_step() >= 0

    async def _stopped_unasked(self) -> None:
        """The ranks exited on a SIGTERM this agent did not send (an operator, another node's
        rank: they all agree on the step). Nothing is lost; the coordinator relaunches."""
        self.detected_at = time.time()
        self._stopping = True
        await self._wait_ranks_gone(min(self.spec.stop_grace_period_s, 2.0))
        self._drain_beats()
        self.exit_step = self._exit_step()
        self.reason = self._exit_reason(asked=False)
        log.warning("%s", self.reason, extra=self._ctx)
        left = await procs.stop_generation(self._markers(), self._live_launched(), grace_s=0)
        if left:
            log.error("processes left after the ranks' exit: %s", left, extra=self._ctx)
        self.stopped_at = time.time()
        self.cause = FailureCause.SIGTERM
        self._set(GenerationState.STOPPED)
        self._close()

    async def _fail(self, rank: int, reason: str, cause: FailureCause, grace_s: float = 0) -> None:
        self.detected_at = time.time()
        if rank in self.ranks and self.ranks[rank].last_beat:
            metrics.DETECTION.observe(time.monotonic() - self.ranks[rank].last_beat)
        self.failed_rank, self.reason, self.cause = rank, reason, cause
        log.warning("rank %d failed: %s; tearing down", rank, reason, extra={**self._ctx, "rank": rank})
        self._stopping = True
        left = await procs.stop_generation(self._markers(), self._live_launched(), grace_s=grace_s)
        if left:
            log.error("processes left after teardown: %s", left, extra=self._ctx)
        self.stopped_at = time.time()
        self._set(GenerationState.FAILED)
        self._close()

    async def _launch_exited(self, code: int) -> None:
        """msrun exited (cold), or every rank did (warm: the scheduler leaves once they are gone)."""
        if code == 0 and all(r.finished for r in self.ranks.values()):
            self._set(GenerationState.SUCCEEDED)
            left = await procs.stop_generation(self._markers(), self._live_launched(), grace_s=1)
            if left:
                log.error("processes left after success: %s", left, extra=self._ctx)
            self._close()
        else:
            who = "msrun" if self._msrun is not None else "the ranks"
            culprit = self._worker_msrun_saw_die() if code else None
            if culprit is not None:
                rank, pid, status = culprit
                log.warning("msrun exited before this agent saw a rank die; msrun's log names rank %d (pid %d, %s); "
                            "ranks as seen: %s", rank, pid, status, self._ranks_seen(), extra=self._ctx)
                await self._fail(rank, f"exited before finishing (pid {pid}, {status}; seen by msrun)",
                                 FailureCause.RANK_EXITED)
                return
            if code and not all(r.finished for r in self.ranks.values()):
                log.warning("%s exited with code %d; ranks as seen: %s", who, code, self._ranks_seen(), extra=self._ctx)
            await self._fail(-1, f"{who} exited with code {code}; see {self.log_dir}", FailureCause.MSRUN_FAILED)

    #: msrun's line when one of its workers exits with an error (``process_entity/_api.py``).
    _MSRUN_WORKER_DIED = re.compile(rb"Worker process (\d+) exit with exception\. Error code: (-?\d+)")

    def _exits_msrun_saw(self) -> dict[int, int]:
        """pid -> exit code of the workers msrun's log says exited with an error (it reaps its workers
        once a second, often before this agent reads their status), for pids no longer running.
        Read through the file root opened for msrun (:func:`_open_own`), never by its path: the folder
        is the worker user's, who could put a FIFO (a read that blocks the event loop), a link to
        /dev/zero or a text of their own there. Its last 64 KiB: msrun writes that line last."""
        if self._msrun is None or self._log is None:
            return {}
        try:
            fd = os.open(f"/proc/self/fd/{self._log.fileno()}", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return {}
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, 1 << 16, max(0, size - (1 << 16)))
        except OSError:
            return {}
        finally:
            os.close(fd)
        return {int(m.group(1)): int(m.group(2)) for m in self._MSRUN_WORKER_DIED.finditer(tail)
                if not os.path.exists(f"/proc/{int(m.group(1))}")}

    def _worker_msrun_saw_die(self) -> tuple[int, int, str] | None:
        """(rank, pid, how) of the worker msrun's log says exited with an error, when this agent did not
        see it die (msrun exits at once on n1 and the like, with no scheduler to wait for; this
        agent's poll may have been held up, on a busy node, until after both). The rank: the one
        with that pid, else the only one whose pid was never learned; None when the log names none
        of them (msrun failed by itself)."""
        unknown = [rs for rs in self.ranks.values() if not rs.pid and not rs.finished]
        for pid, code in self._exits_msrun_saw().items():
            rs = next((r for r in self.ranks.values() if r.pid == pid), None) or \
                (unknown[0] if len(unknown) == 1 else None)
            if rs is not None:
                rs.exit_code = code
                return rs.rank, pid, verdict.exit_status(code)
        return None

    def _ranks_seen(self) -> str:
        """Each local rank as this agent last saw it (for a log line when msrun tells first)."""
        def state(rs: RankState) -> str:
            if rs.finished:
                return "finished"
            return "alive" if rs.pid and procs.alive(rs.pid, rs.create_time) else "gone"

        return "; ".join(f"rank {rs.rank}: pid {rs.pid or '?'}, {state(rs)}, step {rs.step}"
                         for rs in self.ranks.values())

    def _set(self, state: GenerationState, reason: str | None = None) -> None:
        check_generation_transition(self.state, state)
        self.state = state
        if reason is not None and not self.reason:
            self.reason = reason
        log.info("generation %s", state.value, extra=self._ctx)
        self._on_change(self, True)

    # -- reporting ---------------------------------------------------------

    def report(self) -> GenerationReport:
        steps = [r.step for r in self.ranks.values()]
        loss = next((r.loss for r in self.ranks.values() if r.step == max(steps)), 0.0)
        return GenerationReport(
            job=self.spec.name, generation=self.plan.generation, node_id=self.node_id, state=self.state,
            failed_rank=self.failed_rank, reason=self.reason, detected_at=self.detected_at,
            stopped_at=self.stopped_at, first_step_at=self.first_step_at, resumed_step=self.resumed_step,
            resume_note=self.resume_note, step=max(steps), loss=loss, exit_step=self.exit_step, cause=self.cause,
            resumed_steps={str(r.rank): r.resumed_step for r in self.ranks.values() if r.resumed_step >= 0},
            warm=bool(self.standbys))
