"""How a generation's processes start on this node: cold (msrun starts the scheduler and the
ranks) or warm (standbys of the fork server are handed the generation), as the worker user, in a
session of their own, dying with elasticd. :class:`Launch` holds what was started."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import json
import logging
import os
import socket
import stat
import sys
import threading
import time
from typing import Any, Callable, Iterable

import psutil

from mselastic.agent.containment import procs
from mselastic.agent.generation import observe
from mselastic.agent.containment.cgroups import CgroupError, Group, join_prefix
from mselastic.agent.containment.jobfiles import bounded
from mselastic.agent.generation.launch_env import LaunchEnv
from mselastic.agent.generation.preflight import LaunchError
from mselastic.agent.generation.ranks import RankState
from mselastic.agent.generation.shim import AdoptedShim, Handle, WarmRecord
from mselastic.agent.standbys.forkserver import Forked, ForkServer, Orphan, Proc, Standby
from mselastic.agent.containment.users import WorkerUser, batch_prefix
from mselastic.core import retries
from mselastic.core.model import Member
from mselastic.core.pdeathsig import as_user, with_parent_death
from mselastic.core.states import FailureCause
from mselastic.core.waits import within

log = logging.getLogger(__name__)


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
                          cwd: str, *, batch: bool = True, group: Group | None = None, shim: Handle | None = None,
                          outlives_elasticd: bool = False, **io: Any) -> asyncio.subprocess.Process:
    """Start ``cmd`` as the worker user, in a session of its own, dying with elasticd (msrun, a
    standby). ``job_env`` (the job spec's variables) is added after the user switch: it reaches the
    process through a pipe that ``mselastic.agent.containment.envexec`` reads, so nothing runs as root with it
    (``LD_PRELOAD``, if an admin allows it), it is never on disk, and elasticd needs no right to write
    in the worker user's folders. ``batch``: under the ``SCHED_BATCH`` policy, inherited by every
    process and thread it starts (see above). ``group``: the cgroup it starts in, before it runs
    anything of the job's (:func:`mselastic.agent.containment.cgroups.join_prefix`, which also makes it, and
    all it starts, the OOM killer's choice before elasticd). ``shim``: started through the
    generation's shim, which becomes its parent (``io``'s stdout goes to the process; the
    shim's stdout is a pipe on which it says the pid: :meth:`Handle.parent`). ``outlives_elasticd``:
    without the parent-death signal (a fork server: see :func:`spawn_standby`). ``io``: stdin,
    stdout, stderr as for asyncio's subprocesses. Raises OSError or RuntimeError when it cannot
    be started."""
    if batch:
        cmd = [*batch_prefix(), *cmd]
    who = user if user is not None and user.switch else None
    env_r = env_w = -1
    if who is not None:
        env_r, env_w = os.pipe()
        cmd = [sys.executable, "-m", "mselastic.agent.containment.envexec", str(env_r), "--", *cmd]
    else:
        env = {**env, **job_env}
    started = False
    pass_fds = (env_r,) if who else ()
    prefix: list[str] = []
    spawn_env: dict[str, str] | None = env
    shim_r = shim_w = -1
    if shim is not None:
        # The shim runs as root with elasticd's environment: the process's own (the generation's
        # marker among it) reaches it through a pipe, for its child alone.
        shim_r, shim_w = os.pipe()
        out = io["stdout"].fileno()
        # (No parent-death signal: the generation outlives elasticd, its shim fencing it on the
        # deadline a successor must move on in time; see agent.generation.adopt.)
        prefix = [*shim.command(out, pass_fds, cwd, env_fd=shim_r), "--"]
        pass_fds, cwd, spawn_env = (*pass_fds, out, shim_r), os.getcwd(), None
        io = dict(io, stdout=asyncio.subprocess.PIPE, stderr=None)
    try:
        proc = await asyncio.create_subprocess_exec(
            *prefix, *join_prefix([group] if group else []),
            *(as_user if outlives_elasticd else with_parent_death)(cmd, who.setpriv_args() if who else None),
            env=spawn_env, cwd=cwd, start_new_session=True, pass_fds=pass_fds, **io)
        started = True
    finally:
        for fd in (env_r, shim_r):
            if fd >= 0:
                os.close(fd)
        for fd in (env_w, shim_w):
            if fd >= 0 and not started:
                os.close(fd)
    if shim_w >= 0:
        threading.Thread(target=_write_and_close, args=(shim_w, json.dumps(env).encode()),
                         name=f"shim-env-{proc.pid}", daemon=True).start()
    if env_w >= 0:
        # A daemon thread of its own, not awaited: a job env larger than the pipe waits for envexec
        # to read it, and one that never reads (stopped, killed) must hold nothing up; its end of
        # the pipe closing ends the write.
        threading.Thread(target=_write_and_close, args=(env_w, json.dumps(job_env).encode()),
                         name=f"env-{proc.pid}", daemon=True).start()
    return proc


async def spawn_standby(env: LaunchEnv, marker: str, fd: int) -> asyncio.subprocess.Process:
    """Start a standby worker for ``env``'s job (see ``mselastic.trainer.standby``): as the worker
    user, with the job's environment and ``marker``, in the script's folder; ``fd`` (its end of a
    socket pair) as its standard input, output and error; in a cgroup of the job's of its own, where
    the standbys it forks (a fork server) stay until a generation takes them. It does not die with
    elasticd (the ranks it forked die with it): it ends when elasticd's end of its socket closes and
    no process it forked is left (see ``mselastic.trainer.standby.serve``)."""
    group = pool_group(env, marker)
    if group is not None:
        group.make()
    return await spawn_as_worker([sys.executable, "-m", "mselastic.trainer.standby"], env.standby_env(marker),
                                 env.job_env(), env.user, env.cwd, batch=env.batch_scheduling, group=group,
                                 outlives_elasticd=True, stdin=fd, stdout=fd, stderr=fd)


def pool_group(env: LaunchEnv, marker: str) -> Group | None:
    return env.job_group.child("pool-" + marker.rpartition(".")[2]) if env.job_group else None


async def release_standby_group(env: LaunchEnv, marker: str) -> None:
    """Once the fork server started with ``marker`` has ended: stop whatever is left in its cgroup
    (a process the job's own code started in it and detached: its import runs the job's
    ``sitecustomize``, say) and remove the group. Its standbys are gone by then: a taken one was
    moved into its generation's group, the rest died with the server."""
    group = pool_group(env, marker)
    if group is not None:
        left = await group.stop()
        if left:
            log.warning("standby cgroup %s: pids %s still there after SIGKILL", group.rel, left)
    await remove_exits(env.standby_exits(marker))


async def remove_exits(path: str) -> None:
    """Remove a fork server's record of its children's ends once it has ended (a file of the job's
    folder: off the event loop, bounded; not there, or storage not answering: left)."""
    with contextlib.suppress(OSError):
        await bounded(os.unlink, path)


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


def open_own(path: str) -> Any:
    """``path`` (msrun.log, which preflight made as root in the folder it then hands to the worker
    user) opened for appending, only as the file root made: never through a symlink or a hard link
    a job planted there since (root would append to a file of the job's choosing)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK)  # (a FIFO: ENXIO, not a hang)
    os.set_blocking(fd, True)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise RuntimeError(f"{path} is not the log file elasticd made (replaced since)")
    return os.fdopen(fd, "ab")


async def listening(port: int, proc: Proc, within_s: float) -> bool:
    """Wait until something on this node listens on TCP ``port`` (``proc``, a scheduler just handed
    its generation), at most ``within_s`` and while ``proc`` runs; nothing connects to it to find out."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.returncode is None:  # (killed by a stop: returns)
        if await asyncio.to_thread(observe.listens, port):  # (the tables can be long: off the event loop)
            return True
        await asyncio.sleep(0.01)
    return False


async def reachable(host: str, port: int, within_s: float, stopping: Callable[[], bool]) -> bool:
    """Wait until a TCP connection to ``host:port`` (node 0's scheduler) opens, at most
    ``within_s`` and while ``stopping()`` is false. The connection is closed at once, with
    nothing sent: MindSpore's scheduler drops it and goes on (a probe connecting five times
    before a plain msrun job's workers did: the job ran as without it)."""
    async def connect() -> None:
        _, writer = await within(asyncio.open_connection(host, port), 1.0)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    try:
        await retries.until_no_error((OSError, asyncio.TimeoutError), within_s, jitter_s=(0.02, 0.1),
                                     done=stopping)(connect)
        return True
    except (OSError, asyncio.TimeoutError):
        return False



class StandbyGone(OSError):
    """The first standby of a handover was gone when handed its part (nothing was handed over)."""


class Path(enum.Enum):
    """How a generation's processes start here."""

    COLD = "cold"  # msrun starts the scheduler (node_rank 0) and the local ranks
    WARM = "warm"  # standbys of the fork server are handed the generation: no msrun


class UnderShim:
    """msrun started by the generation's shim: msrun's pid; the shim's wait and code, which are
    msrun's (it exits as msrun did: see :mod:`mselastic.agent.generation.shim`)."""

    def __init__(self, shim: asyncio.subprocess.Process | AdoptedShim, pid: int) -> None:
        self.shim, self.pid = shim, pid

    @property
    def returncode(self) -> int | None:
        return self.shim.returncode

    async def wait(self) -> int:
        return await self.shim.wait()

    def kill(self) -> None:
        """The shim killed: msrun's parent-death signal kills msrun, and the ranks with it."""
        with contextlib.suppress(ProcessLookupError):
            self.shim.kill()


class Launch:
    """What elasticd started for one generation on this node (msrun, or the standbys it took over:
    the scheduler's first on node_rank 0) and msrun's log; the rank each warm worker became."""

    def __init__(self, run_id: str, member: Member, standbys: list[Standby], ctx: dict[str, Any]) -> None:
        self.run_id, self.member, self._ctx = run_id, member, ctx
        self.standbys = list(standbys)
        self.path = Path.WARM if self.standbys else Path.COLD
        self.msrun: asyncio.subprocess.Process | UnderShim | None = None
        #: The generation's shim: msrun's parent, when it has not been started to guard alone.
        self.shim: Handle | None = None
        #: Warm: the process each local rank is (a standby handed it, or one an earlier elasticd
        #: handed it, adopted: :meth:`adopt_warm`), and the scheduler's on node_rank 0.
        self.warm_ranks: dict[int, Proc] = {}
        self.scheduler: Proc | None = None
        #: Markers of an adopted generation's processes (its record's).
        self.adopted_markers: set[str] = set()
        #: msrun.log, opened by root before anything of the generation runs (see :func:`open_own`).
        self.log: Any = None
        #: The generation's cgroup (None: no cgroups here): its processes, whatever they do.
        self.group: Group | None = None

    def open_log(self, log_dir: str) -> None:
        self.log = open_own(os.path.join(log_dir, "msrun.log"))

    async def go_cold(self) -> None:
        """Give up the standbys (killed): the generation starts under msrun."""
        standbys, self.standbys = self.standbys, []
        self.path = Path.COLD
        await asyncio.gather(*(sb.kill() for sb in standbys))

    async def warm(self, env: LaunchEnv, ranks: list[RankState], stopping: Callable[[], bool]) -> bool:
        """The warm path, once the generation is prepared: wait for standbys still importing and
        (off node_rank 0) for node 0's scheduler, then hand the generation over; a standby that
        dies or is not ready in time sends it cold instead (:attr:`path` says which it went).
        True once its processes run; False when it was stopped meanwhile. Raises LaunchError when
        msrun could not be started instead, and what a failed handover raised."""
        if any(not sb.ready_at for sb in self.standbys) and not await self._standbys_ready(env, stopping):
            return False
        if self.path is Path.WARM and self.member.node_rank != 0 and not await self._scheduler_reached(env, stopping):
            return False
        if self.path is Path.WARM and any(sb.gone() for sb in self.standbys):
            return await self._cold_instead(env, "a standby worker exited before its handover", stopping)
        if self.path is Path.WARM:
            try:
                await self.hand_over(env, ranks, stopping)
            except StandbyGone as e:  # (its fork server killed meanwhile: they all die with it)
                return await self._cold_instead(env, str(e), stopping)
        return True

    async def _standbys_ready(self, env: LaunchEnv, stopping: Callable[[], bool]) -> bool:
        """Standbys taken while still importing: wait for them, as for a cold start's ranks, within
        startup_timeout_s. One that exits first (the OOM killer) or is not ready in time sends the
        generation cold, as one found dead when taken does, rather than blame the node."""
        importing = [sb for sb in self.standbys if not sb.ready_at]
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(sb.until_ready(env.spec.startup_timeout_s) for sb in importing))
        except RuntimeError as e:
            return not stopping() and await self._cold_instead(env, str(e), stopping)
        log.info("waited %.1fs for standbys %s to finish importing", time.monotonic() - t0,
                 [sb.pid for sb in importing], extra=self._ctx)
        return not stopping()

    async def _scheduler_reached(self, env: LaunchEnv, stopping: Callable[[], bool]) -> bool:
        """On a node other than node_rank 0: wait until node 0's scheduler can be reached (node 0
        may still be stopping the previous generation; a worker MindSpore's scheduler refuses
        retries only half a second later), ``SCHEDULER_REACH_S`` at most, then hand over anyway.
        A standby that died meanwhile sends the generation cold."""
        host, port = scheduler_host(env.plan.master_addr), env.plan.master_port
        if not await reachable(host, port, SCHEDULER_REACH_S, stopping) and not stopping():
            log.warning("the scheduler at %s:%d was not reachable within %.0fs; the workers are handed over "
                        "and retry on their own", host, port, SCHEDULER_REACH_S, extra=self._ctx)
        if stopping():
            return False
        if not all(sb.alive for sb in self.standbys):
            return await self._cold_instead(env, "a standby worker exited while waiting for the scheduler", stopping)
        return True

    async def _cold_instead(self, env: LaunchEnv, why: str, stopping: Callable[[], bool]) -> bool:
        """Start the generation under msrun after all, its standbys killed, rather than blame the
        node. False when the generation was stopped meanwhile."""
        log.warning("%s; starting cold", why, extra=self._ctx)
        await self.go_cold()
        try:
            await self.start_cold(env, MSRUN)
        except (OSError, RuntimeError) as err:
            raise LaunchError(FailureCause.LAUNCH_NODE, f"msrun could not be started: {err}") from None
        if stopping():  # stopped while msrun was being started: it may not have been seen
            await self.teardown(grace_s=0)
            return False
        return True

    async def start_cold(self, env: LaunchEnv, msrun: str) -> None:
        """The cold path: msrun starts the scheduler (on node_rank 0) and the local ranks."""
        assert self.log is not None
        p = env.plan
        shim = self.shim if self.shim is not None and self.shim.proc is None else None
        proc = await spawn_as_worker(env.msrun_command(msrun, self.member), env.env(), env.job_env(), env.user,
                                     env.cwd, batch=env.batch_scheduling, group=self.group, shim=shim,
                                     stdin=asyncio.subprocess.DEVNULL,
                                     stdout=self.log, stderr=asyncio.subprocess.STDOUT)
        self.msrun = UnderShim(proc, await shim.parent(proc)) if shim is not None else proc
        first = p.first_rank(env.node_id)
        log.info("generation launched: msrun pid %d, master %s:%d, ranks %d..%d, logs %s", self.msrun.pid,
                 p.master_addr, p.master_port, first, first + self.member.local_workers - 1, env.log_dir,
                 extra=self._ctx)

    async def hand_over(self, env: LaunchEnv, ranks: list[RankState], stopping: Callable[[], bool]) -> None:
        """The warm path: the standbys become the processes msrun would have started, with msrun's
        environment (:meth:`LaunchEnv.handover_env`; the scheduler ``MS_ROLE=MS_SCHED`` and
        ``RANK_ID=0``; each worker ``MS_ROLE=MS_WORKER``, ``RANK_ID``/``MS_NODE_ID`` its global rank,
        ``DEVICE_ID`` its local index), its log files, arguments and working directory. The scheduler
        (node_rank 0: the node whose address is master_addr) goes first and the workers once it
        listens, all of them at once: workers that meet no scheduler retry only half a second later
        (on the other nodes they are handed over once it can be reached: see :func:`reachable`)."""
        p = env.plan
        common = env.handover_env(scheduler_host(p.master_addr))
        argv = [env.spec.script, *env.spec.args]
        standbys = list(self.standbys)
        lines = []
        try:  # the first one: gone (with its fork server), the generation may still start cold
            self._join(standbys[0])
        except CgroupError as e:
            raise StandbyGone(str(e)) from None
        if self.member.node_rank == 0:
            scheduler = standbys.pop(0)
            path = os.path.join(env.log_dir, "scheduler.log")
            try:
                await scheduler.hand_over({**common, "MS_ROLE": "MS_SCHED", "RANK_ID": "0"}, argv, env.cwd, path)
            except OSError as e:
                raise StandbyGone(f"standby pid {scheduler.pid} could not take the scheduler's part: {e}") from None
            self.scheduler = scheduler.proc
            lines.append(f"Start scheduler process (warm: standby pid {scheduler.pid}), log file:{path}.")
            # The workers go once it listens (a worker that meets no scheduler retries only half a
            # second later), or after a while anyway: they retry, and startup_timeout_s bounds it all.
            await listening(p.master_port, scheduler.proc, within_s=SCHEDULER_LISTEN_S)
            if scheduler.proc.returncode is not None:
                raise RuntimeError(f"the scheduler (standby pid {scheduler.pid}) exited with code "
                                   f"{scheduler.proc.returncode}; see {path}")
        for i, (rs, standby) in enumerate(zip(ranks, standbys)):
            if stopping():
                return
            path = os.path.join(env.log_dir, f"worker_{rs.rank}.log")
            if i or self.member.node_rank == 0:
                self._join(standby)
            try:
                await standby.hand_over({**common, "MS_NODE_ID": str(rs.rank), "MS_ROLE": "MS_WORKER",
                                         "RANK_ID": str(rs.rank), "DEVICE_ID": str(i)}, argv, env.cwd, path)
            except OSError as e:
                if i or self.member.node_rank == 0:
                    raise
                raise StandbyGone(f"standby pid {standby.pid} could not take rank {rs.rank}'s part: {e}") from None
            rs.pid, rs.create_time = standby.pid, psutil.Process(standby.pid).create_time()
            self.warm_ranks[rs.rank] = standby.proc
            lines.append(f"Start worker process with rank id:{rs.rank} (warm: standby pid {standby.pid}), "
                         f"log file:{path}.")
        if self.log is not None:  # (closed: stopped meanwhile)
            self.log.write("".join(line + "\n" for line in lines).encode())  # what msrun would have said
            self.log.flush()
        log.info("generation launched warm: standbys %s, master %s:%d, ranks %d..%d, logs %s",
                 [sb.pid for sb in self.standbys], p.master_addr, p.master_port, ranks[0].rank if ranks else -1,
                 ranks[-1].rank if ranks else -1, env.log_dir, extra=self._ctx)

    def _join(self, standby: Standby) -> None:
        """Move a standby (and anything it started) into the generation's cgroup before its handover:
        by the pidfd its fork server's child was opened as when the server named it (never a pid
        reused meanwhile); one elasticd started itself is its child, not reaped while alive."""
        if self.group is None:
            return
        proc = standby.proc
        if isinstance(proc, Forked):
            if proc.returncode is not None:
                raise CgroupError(f"cannot move standby pid {standby.pid}: it ended")
            self.group.move(standby.pid, proc.pidfd)
            return
        try:
            fd = os.pidfd_open(standby.pid)
        except OSError as e:
            raise CgroupError(f"cannot move standby pid {standby.pid}: {e.strerror}") from None
        try:
            self.group.move(standby.pid, fd)
        finally:
            os.close(fd)

    async def teardown(self, grace_s: float) -> list[int]:
        """Stop every process of the generation (see :func:`mselastic.agent.containment.cgroups.Group.stop`; with
        no cgroups, :func:`mselastic.agent.containment.procs.stop_generation`); returns the pids left."""
        if self.group is not None:
            return await self.group.stop(self.live(), grace_s=grace_s)
        return await procs.stop_generation(self.markers(), self.live(), grace_s=grace_s)

    def launched(self) -> list[Proc]:
        """The processes elasticd started for this generation: msrun, or the standbys it took over
        (adopted: the processes they became)."""
        if self.msrun is not None:
            return [self.msrun]
        if self.standbys:
            return [sb.proc for sb in self.standbys]
        return [*self.warm_ranks.values(), *([self.scheduler] if self.scheduler is not None else [])]

    def markers(self) -> set[str]:
        """Every marker a process of this generation carries in its environment (a standby's own
        is there too, were its handover's rewrite of the kernel's copy not to have happened)."""
        return {self.run_id} | {sb.marker for sb in self.standbys} | self.adopted_markers

    def server(self) -> ForkServer | None:
        """The fork server whose children the warm ranks and scheduler are (None: cold, adopted, or
        forked by two servers: the pool's replaced between two standbys)."""
        servers = {p.server if isinstance(p, Forked) else None for p in self.launched()}
        return servers.pop() if len(servers) == 1 else None

    def adopt_warm(self, warm: WarmRecord, markers: Iterable[str]) -> None:
        """Take over the warm ranks (and scheduler) an earlier elasticd handed this generation to,
        each as an :class:`Orphan` (raises OSError when one is gone already: not adopted)."""
        self.path, self.adopted_markers = Path.WARM, set(markers)
        server = (warm.server, warm.server_start)
        try:
            for rank, (pid, start) in sorted(warm.ranks.items()):
                self.warm_ranks[rank] = Orphan(pid, start, warm.exits, server)
            if warm.scheduler is not None:
                self.scheduler = Orphan(*warm.scheduler, warm.exits, server)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Stop watching the warm ranks, leaving them running (the generation is left to its shim)."""
        for proc in self.launched():
            if isinstance(proc, (Forked, Orphan)):
                proc.release()

    def live(self) -> list[psutil.Process]:
        """The launched processes still running."""
        live = []
        for proc in self.launched():
            if proc.returncode is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    live.append(psutil.Process(proc.pid))
        return live

    def warm_scheduler(self) -> Proc | None:
        """The process that became this generation's scheduler (warm, node_rank 0), once handed over."""
        return self.scheduler if self.warm_ranks else None

    def handles(self) -> list[Any]:
        """The processes whose exit elasticd is told of (asyncio's wait): msrun, or the warm ranks
        and scheduler."""
        handles: list[Any] = [self.msrun, *self.warm_ranks.values(), self.warm_scheduler()]
        return [h for h in handles if h is not None]

    def exit_code(self) -> int | None:
        """msrun's exit code; warm: once every rank has exited, theirs (the first that is not 0);
        None while they run."""
        if self.msrun is not None:
            return self.msrun.returncode
        codes = [proc.returncode for proc in self.warm_ranks.values()]
        if not codes or any(c is None for c in codes):
            return None
        return next((c for c in codes if c), 0)

    def note_exit_codes(self, ranks: Iterable[RankState]) -> None:
        """How each rank whose pid is known ended, once it has: a warm rank is its fork server's
        child, the server reaps it and says how it ended (its code counts once the kernel says it
        has ended; until then it is a zombie too); msrun's, as the kernel says before msrun reaps it."""
        for rs in ranks:
            if rs.pid and rs.exit_code is None:
                proc = self.warm_ranks.get(rs.rank)
                code = proc.returncode if proc is not None else None
                rs.exit_code = code if code is not None else procs.exit_status(rs.pid, rs.create_time)

    async def only_the_scheduler_waits(self, ranks: list[RankState], master_port: int) -> bool:
        """Cold, on node_rank 0: every local rank said it finished and exited with code 0, and no
        worker of any node is connected to the scheduler any more (no established connection on
        the master port; each worker holds two while it runs, and a node lost without closing them
        keeps them). msrun then only waits for its scheduler, which sees its workers gone at a
        poll every 5 s (MindSpore's ``meta_server_node`` Finalize): 2.5 s of every job's end on
        average, a node held for nothing. The warm path ends once its ranks have (the scheduler is
        a standby). Otherwise msrun's own exit decides."""
        if self.msrun is None or self.member.node_rank != 0 or not ranks:
            return False
        if not all(rs.finished and rs.exit_code == 0 for rs in ranks):
            return False
        return not await asyncio.to_thread(observe.connected, master_port)

    def msrun_exits(self) -> dict[int, int]:
        """What msrun's log says of its workers' exits (see :func:`observe.msrun_exits`); {} warm."""
        if self.msrun is None or self.log is None:
            return {}
        return observe.msrun_exits(self.log)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
        for standby in self.standbys:  # (their end of the socket pair is gone since their handover)
            standby.writer.close()
