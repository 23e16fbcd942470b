"""One generation of a job on this node, from launch to its end: :class:`Generation` observes its
processes, has :func:`mselastic.agent.generation.verdict.judge` say what a look means, and acts on it.

The generation starts cold (msrun, in a new session, its parent the generation's shim, which
outlives elasticd: :mod:`mselastic.agent.generation.shim`, and a successor adopts it: :meth:`Generation.adopt`)
or warm (standbys handed over: :mod:`mselastic.agent.generation.launch`; the shim only guards them), with the
environment of the trainer contract (:mod:`mselastic.agent.generation.launch_env`). It then watches the
workers themselves, not only msrun: msrun notices a dead rank only after its scheduler times out
(~35 s). A worker that is gone (or a zombie) without having said ``finished``, or silent for longer
than the hang timeout, fails the generation at once; every process of the generation is then torn
down and the generation reported.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import logging
import os
import subprocess
import time
import uuid
from typing import Awaitable, Callable

import psutil

from mselastic import metrics
from mselastic.agent.containment import procs
from mselastic.agent.generation import learned as learned_rules, observe, ranks as rank_rules, shim, verdict
from mselastic.agent.generation.beats import BeatSocket, Senders
from mselastic.agent.containment.cgroups import CgroupError, Group, Limits, Tree, effective, join_prefix
from mselastic.agent.devices.health import evidence
from mselastic.agent.containment.jobfiles import Unreadable, bounded
from mselastic.agent.generation.launch import MSRUN, Launch, Path, UnderShim, open_own, pool_group
from mselastic.agent.generation.launch_env import LaunchEnv, heartbeat_socket
from mselastic.agent.generation.preflight import LaunchError, port_free, preflight
from mselastic.agent.generation.ranks import JOINED, RankState
from mselastic.agent.containment.snapshot_folders import snapshot_folder
from mselastic.agent.standbys.forkserver import Standby
from mselastic.agent.generation.stop import signal_ranks, write_stop_step
from mselastic.agent.containment.users import WorkerUser
from mselastic.core import contract
from mselastic.core.contract import Beat, BeatKind
from mselastic.core.model import GenerationReport, Plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import FailureCause, GenerationState, check_generation_transition
from mselastic.core.waits import within

log = logging.getLogger(__name__)

#: A rank still inside ``init()`` this long after a local peer returned from it is asleep in MindSpore's
#: CPU collective address exchange (``contract.NUDGE_SIGNAL``): it is nudged. The rest of ``init()``
#: after the exchange takes a few milliseconds.
NUDGE_AFTER_S = 0.1

#: How long a launch's checks (:func:`preflight`: files on shared storage, the worker user's probes)
#: may take before the launch fails on this node (at most a third of the job's startup_timeout_s).
PREFLIGHT_S = 60.0

#: A stop the agent names for its own ranks covers the steps they make in this long (the SIGTERM
#: reaches a rank busy in a step; a fast job makes several steps meanwhile).
LOCAL_STOP_LATENCY_S = 0.25
#: The most a planned stop adds to its grace for the ranks to reach a named stop step at their
#: measured rate (a few steps on a busy node): within the leader's push timeout (10 s), which its
#: Stop call waits on top of the grace.
STEPS_TO_GO_MAX_S = 5.0


class Phase(enum.Enum):
    """Where a generation's launch stands on this node (its outcome is its GenerationState)."""

    PREPARING = "preparing"  # made, not started
    LAUNCHING = "launching"  # preflight done, msrun started or standbys being handed over
    WATCHING = "watching"  # every process started: the watch looks at them
    STOPPING = "stopping"  # a stop (planned or not) or a teardown under way
    CLOSED = "closed"  # nothing of it runs; its socket, log and wake-ups are closed
    LEFT = "left"  # left to its shim by an elasticd going away (a planned restart); handles closed


class Generation:
    """One plan's launch on this node: msrun, its scheduler and the local ranks (or standbys that
    became them: see :class:`mselastic.agent.generation.launch.Launch`)."""

    def __init__(self, plan: Plan, spec: JobSpec, node_id: str, work_dir: str,
                 on_change: Callable[["Generation", bool], None], poll_interval_s: float = 0.1,
                 user: WorkerUser | None = None, allow_env: frozenset[str] = frozenset(),
                 pass_env: frozenset[str] = frozenset(), standbys: list[Standby] | None = None,
                 snapshot_root: str = "", batch_scheduling: bool = True, cgroups: Tree | None = None,
                 node_limits: Limits = Limits(), heartbeat_dir: str = "",
                 fence_deadline: Callable[[], float] = lambda: 0.0, lease_ttl_s: float = 0.0,
                 shim_dir: str = "", run_id: str = "", namespace: str = "",
                 learned: learned_rules.Learned | None = None) -> None:
        member = plan.member(node_id)
        if member is None:
            raise ValueError(f"node {node_id} is not a member of generation {plan.generation}")
        self.plan, self.spec, self.node_id, self.member = plan, spec, node_id, member
        self.first_rank = plan.first_rank(node_id)
        self.work_dir, self.namespace = work_dir, namespace
        self.log_dir = os.path.join(work_dir, "logs", spec.name, f"g{plan.generation:06d}")
        #: The planned stop's step, for the ranks: beside the log folder, in elasticd's own folder
        #: (the worker user owns the log folder; elasticd has no right to write there under the unit).
        self.stop_file = self.log_dir + ".stop"
        #: The step this generation's ranks were told to stop at (0: none yet).
        self.stop_at = 0
        #: (monotonic time, highest step) when the highest step changed, the last few: the step rate.
        self._progress: collections.deque[tuple[float, int]] = collections.deque(maxlen=32)
        self._asked: set[int] = set()  # ranks that asked for a stop step (logged once each)
        #: (An adopted generation keeps the one it was started with: agent.generation.adopt.)
        self.run_id = run_id or f"{spec.name}.{plan.generation}.{node_id}.{uuid.uuid4().hex[:8]}"
        #: Where its ranks send their beats (see mselastic.agent.generation.beats).
        self.heartbeat = heartbeat_socket(self.run_id, heartbeat_dir)
        self.state = GenerationState.STARTING
        self.phase = Phase.PREPARING
        self.ranks = {r: RankState(r) for r in range(self.first_rank, self.first_rank + member.local_workers)}
        self._seen: set[int] = set()  # msrun's children already classified
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
        #: Awaited for a failed rank's device (the device id, the line of its log naming a device
        #: error or ""), before the failure is reported: what shows the device failed, set aside, so
        #: that the relaunch avoids it ("": nothing, and the failure stays the rank's).
        self.on_device_fault: Callable[[int, str], Awaitable[str]] | None = None
        #: For a DEVICE failure: that device (-1: none).
        self.failed_device = -1
        #: Awaited before the launch with the member's devices, their kind, the user and the
        #: generation's cgroup: (a device that failed its check, why, whether it was set aside), or
        #: None (see agent.devices.health).
        self.check_devices: Callable[[tuple[int, ...], str, WorkerUser | None, Group | None],
                                     Awaitable[tuple[int, str, bool] | None]] | None = None
        self._remote_joined_at = 0.0
        self._poll_s = poll_interval_s
        #: What this node learned of the job's sections (kept by the node across its generations:
        #: agent.generation.learned); the limits the ranks are judged by.
        self.learned = learned if learned is not None else learned_rules.Learned(spec.startup_timeout_s)
        self.timing = verdict.Timing(spec.hang_timeout_s, spec.startup_timeout_s, spec.stop_grace_period_s,
                                     self.learned)
        self._idle = observe.IdleWatch()
        self._ctx = dict(job=spec.name, generation=plan.generation, node=node_id)
        #: What elasticd started (cold: msrun; warm: the standbys handed this generation).
        self.launch = Launch(self.run_id, member, list(standbys or []), self._ctx)
        #: Wakes the watch when a process of the generation ends (see observe.ExitWatch).
        self.exits = observe.ExitWatch(self._ctx)
        self._beats: BeatSocket | None = None
        self._task: asyncio.Task[None] | None = None
        #: Who the workers run as (None: as elasticd itself), and the env names the admin allows.
        self.user = user
        self.allow_env = allow_env
        self.pass_env = pass_env
        #: Where this node keeps the job's snapshots ("": none; made by :meth:`prepare_snapshots`).
        self.snapshot_root = snapshot_root if spec.snapshot_interval_steps else ""
        self.batch_scheduling = batch_scheduling
        self.snapshot_dir = ""
        #: This node's cgroups (None: none), the job's limits here and its group once started.
        self.cgroups = cgroups
        self.limits = Limits(effective(spec.memory_limit_mb * 2**20, node_limits.memory_bytes),
                             effective(spec.max_processes, node_limits.max_tasks))
        self.job_group: Group | None = None
        #: Taken over from an earlier elasticd (agent.generation.adopt): the ranks' beats of the gap are lost.
        self.adopted = False
        #: How many times an elasticd took it over (the report's, counted on).
        self.adoptions = 0
        #: The generation's shim (see agent.generation.shim): the fence where the workers are, on the deadline
        #: ``fence_deadline()`` says (the node's lease plus the outage grace; 0: none yet). Its files
        #: in ``shim_dir`` (elasticd's own folder on /run; "": beside the log folder).
        self.shim = shim.Handle(os.path.join(shim_dir, self.run_id) if shim_dir else self.log_dir, self._ctx)
        self._fence_deadline, self._lease_ttl_s = fence_deadline, lease_ttl_s
        #: Called once the shim fenced the generation (the node fences as its own deadline says).
        self.on_fenced: Callable[[str], None] = lambda why: None
        #: Warm: the cgroup (relative) of the fork server whose children the ranks are, once the
        #: generation can be left to its shim ("": none): kept while the generation is.
        self.server_group = ""
        #: Warm: its record written and its ranks kept by their fork server (or adopted so).
        self._recorded = False
        #: Adopted warm: the record of ends of the earlier elasticd's fork server ("": none).
        self.server_exits = ""

    # -- lifecycle ---------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """A stop of this generation was asked for (planned or not)."""
        return self.phase in (Phase.STOPPING, Phase.CLOSED, Phase.LEFT)

    def _begin_stop(self) -> None:
        if self.phase not in (Phase.CLOSED, Phase.LEFT):
            self.phase = Phase.STOPPING

    @property
    def launch_env(self) -> LaunchEnv:
        """What this generation's processes are started with."""
        return LaunchEnv(self.spec, self.plan, self.node_id, self.log_dir, self.stop_file, self.run_id, self.user,
                         self.allow_env, self.pass_env, self.batch_scheduling, self.snapshot_dir, self.job_group,
                         self.launch.group, self.heartbeat)

    @property
    def warm(self) -> bool:
        """Launched by handing standbys over (not gone cold meanwhile)."""
        return self.launch.path is Path.WARM

    def take_standbys(self, standbys: list[Standby]) -> None:
        """Before :meth:`start`: the standbys this generation is handed to (warm; none: cold)."""
        self.launch = Launch(self.run_id, self.member, standbys, self._ctx)

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
        if self.cgroups is not None:
            try:
                self.job_group = self.cgroups.job(self.spec.name, self.limits)
                self.launch.group = self.job_group.child(f"gen-{self.run_id}").make()
            except CgroupError as e:
                await self._fail(-1, f"the generation's cgroup could not be made: {e}", FailureCause.LAUNCH_NODE)
                return
        within_s = min(PREFLIGHT_S, self.spec.startup_timeout_s / 3)  # (a part of the start-up's time)
        join = join_prefix([self.launch.group] if self.launch.group else [])
        try:  # (off the event loop, in a thread nothing waits for past the deadline: storage may hang)
            await bounded(preflight, self.spec, self.log_dir, MSRUN, self.user, self.allow_env, join,
                          within_s=within_s)
        except LaunchError as e:
            await self._fail(-1, str(e), e.cause)
            return
        except (Unreadable, subprocess.TimeoutExpired) as e:
            why = "storage not answering" if isinstance(e, Unreadable) else f"storage not answering: {e}"
            await self._fail(-1, f"the launch's checks of {self.spec.script}, {self.spec.checkpoint_dir} and "
                                 f"{self.log_dir} did not finish within {within_s:.0f}s ({why})",
                             FailureCause.LAUNCH_NODE)
            return
        if not await self._devices_pass():
            return
        with contextlib.suppress(FileNotFoundError):  # a step left by an elasticd that died in a stop
            os.unlink(self.stop_file)
        p = self.plan
        if self.member.node_rank == 0 and not port_free(p.master_port):
            # A live scheduler of another job or generation there would capture our workers.
            await self._fail(-1, f"master port {p.master_port} is in use on node {self.node_id}",
                             FailureCause.LAUNCH_NODE)
            return
        self.phase = Phase.LAUNCHING
        try:
            self._open_beats()
        except OSError as e:
            await self._fail(-1, f"the heartbeat socket {self.heartbeat} could not be made: {e}",
                             FailureCause.LAUNCH_NODE)
            return
        if self.launch.path is Path.WARM and not all(sb.alive for sb in self.launch.standbys):
            # One died since it was taken (the OOM killer, a signal): cold, rather than blame the node.
            log.warning("a standby worker exited before its handover; starting cold", extra=self._ctx)
            await self.launch.go_cold()
        if self.stopping:  # (stopped or fenced during the checks: nothing is started)
            return
        try:  # (cold: the shim starts with msrun, as its parent; warm: it guards alone, once handed over)
            self.shim.prepare(shim.Record(
                self.spec.name, p.generation, self.node_id, sorted(self.launch.markers()), self._lease_ttl_s,
                dataclasses.asdict(self.launch.group.layout) if self.launch.group else None,
                self.launch.group.rel if self.launch.group else "",
                self.user.uid if self.user and self.user.switch else -1, run_id=self.run_id,
                work_dir=self.work_dir, namespace=self.namespace), self._fence_deadline())
            self.launch.shim = self.shim
        except (OSError, RuntimeError) as e:
            await self._fail(-1, f"the generation's shim could not be started: {e}", FailureCause.LAUNCH_NODE)
            return
        try:
            self.launch.open_log(self.log_dir)
            if self.launch.path is Path.COLD:
                await self.launch.start_cold(self.launch_env, MSRUN)
        except (OSError, RuntimeError) as e:
            await self._fail(-1, f"msrun could not be started: {e}", FailureCause.LAUNCH_NODE)
            return
        self.started_mono = time.monotonic()
        # The handover waits for the scheduler to listen: in the watcher's task, not in the Launch
        # call (whose deadline would cancel it halfway).
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.run_id}")

    def _open_beats(self) -> None:
        """The heartbeat socket, taking beats from the generation's processes alone (raises OSError)."""
        senders = Senders(lambda: {proc.pid for proc in self.launch.launched()},
                          lambda pid: any(rs.pid == pid for rs in self.ranks.values()),
                          uid=self.user.uid if self.user is not None else os.geteuid(),
                          cgroup="/" + self.launch.group.rel if self.launch.group is not None else "")
        self._beats = BeatSocket(self.heartbeat, senders, self._received, self._ctx,
                                 owner=(self.user.uid, self.user.gid) if self.user and self.user.switch else None)

    def adopt(self, record: shim.Record, child: shim.Child | shim.WarmRecord, report: GenerationReport | None) -> None:
        """Take over this generation from the elasticd that started it (see agent.generation.adopt): msrun
        under its shim, ``child``, still runs, and so do its ranks (found among msrun's children
        at the first look); or (warm, ``child`` a WarmRecord) its guard and the ranks it names,
        children of that elasticd's fork server (a rank that ended meanwhile is seen at the first
        look, its code the server's record). What they did meanwhile is in their beats to come, what
        the earlier elasticd knew in its ``report``, the step they were told to stop at in the stop
        file. Raises OSError (or RuntimeError, ValueError) when a handle cannot be had (the shim
        gone meanwhile, the log, the heartbeat socket), with nothing of this object left open: the
        caller kills it."""
        try:
            self._adopt(record, child, report)
        except BaseException:
            self.launch.release()
            self.launch.close()
            if isinstance(self.shim.proc, shim.AdoptedShim):
                self.shim.proc.close()
            if self._beats is not None:
                self._beats.close()
                self._beats = None
            self.done.set()
            raise

    def _adopt(self, record: shim.Record, child: shim.Child | shim.WarmRecord,
               report: GenerationReport | None) -> None:
        group = record.group()  # (the one it runs in, whatever this elasticd's cgroups setting)
        if group is not None and self.cgroups is not None:
            with contextlib.suppress(CgroupError):
                self.job_group = self.cgroups.job(self.spec.name, self.limits)
        self.launch.group, self.launch.shim, self.adopted = group, self.shim, True
        if isinstance(child, shim.WarmRecord):
            if set(child.ranks) != set(self.ranks):
                raise ValueError(f"its record names ranks {sorted(child.ranks)}, the plan has {sorted(self.ranks)} here")
            self.shim.adopt_guard(child)
            self.launch.adopt_warm(child, record.markers)
            for rank, (pid, start) in child.ranks.items():
                self.ranks[rank].pid, self.ranks[rank].create_time = pid, start
            self.server_group, self._recorded, self.server_exits = child.server_group, True, child.exits
            what = (f"warm ranks {sorted(p for p, _ in child.ranks.values())} (fork server pid {child.server}) "
                    f"under its shim (pid {child.shim})")
        else:
            self.launch.msrun = UnderShim(self.shim.adopt(child), child.pid)
            what = f"msrun pid {child.pid} under its shim (pid {child.shim})"
        self.launch.log = open_own(os.path.join(self.log_dir, "msrun.log"))
        self._open_beats()
        with contextlib.suppress(OSError):  # (a step the ranks may have read is never moved)
            with open(self.stop_file, "rb") as f:
                self.stop_at = contract.decode_stop_step(f.read(64)) or 0
        now = time.monotonic()
        for rs in self.ranks.values():  # (they got through init(); the hang timeout counts from now)
            rank_rules.reach(rs, len(Beat.PHASES), now)
            rs.last_beat = now
            if report is not None:
                rs.step, rs.resumed_step = report.step, report.resumed_steps.get(str(rs.rank), -1)
        if report is not None:
            self.first_step_at, self.resumed_step = report.first_step_at, report.resumed_step
        self.adoptions = (report.adoptions if report is not None else 0) + 1
        self.started_mono, self.phase = now, Phase.WATCHING
        if self.first_step_at:
            self.state = GenerationState.RUNNING
        log.info("generation adopted: %s, started by an earlier elasticd", what, extra=self._ctx)
        self._task = asyncio.create_task(self.watch(), name=f"watch-{self.run_id}")

    async def _run(self) -> None:
        if self.launch.path is Path.WARM and not await self._warm_launch():
            return
        if self.shim.proc is None and not self.stopping:
            # Warm: the guard starts once the ranks are handed over (its Python start-up, under the
            # default policy, would preempt their registration with the scheduler, the race
            # MindSpore loses: journal, "A race MindSpore loses"; elasticd's own check fences meanwhile).
            try:
                await self.shim.guard()
            except (OSError, RuntimeError) as e:
                await self._fail(-1, f"the generation's shim could not be started: {e}", FailureCause.LAUNCH_NODE)
                return
            await self._record_warm()
        if not self.stopping:
            self.phase = Phase.WATCHING
            await self.watch()

    async def _record_warm(self) -> None:
        """Warm, once handed over and guarded: write what a successor of elasticd adopts the
        generation by (:class:`shim.WarmRecord`), then tell the fork server to keep the ranks when
        elasticd is gone (until then it kills them as elasticd's end closes: unguarded, they must not
        train on). Without both the generation cannot be left: a restart of elasticd stops it."""
        server, sched = self.launch.server(), self.launch.scheduler
        if server is None or self.shim.proc is None or self.shim.proc.returncode is not None:
            return
        try:
            record = shim.WarmRecord(
                self.shim.proc.pid, psutil.Process(self.shim.proc.pid).create_time(), server.pid, server.start_time(),
                self.launch_env.standby_exits(server.marker),
                {rs.rank: (rs.pid, rs.create_time) for rs in self.ranks.values() if rs.rank in self.launch.warm_ranks},
                (sched.pid, psutil.Process(sched.pid).create_time()) if sched is not None else None,
                g.rel if (g := pool_group(self.launch_env, server.marker)) is not None else "")
            record.write(self.shim.paths)
            await server.keep([p.pid for p in self.launch.launched()])
        except (OSError, RuntimeError, psutil.Error) as e:
            log.warning("the warm generation's record not written (%s): a restart of elasticd will stop it", e,
                        extra=self._ctx)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shim.paths.warm)
            return
        self.server_group, self._recorded = record.server_group, True

    async def _warm_launch(self) -> bool:
        """Hand the generation to its standbys (see :meth:`Launch.warm`: it may go cold instead).
        False when it was stopped meanwhile or could not start."""
        try:
            if not await self.launch.warm(self.launch_env, list(self.ranks.values()),
                                          lambda: self.stopping or self.shim.fenced() is not None):
                return False
        except asyncio.CancelledError:
            raise
        except LaunchError as e:
            await self._fail(-1, str(e), e.cause)
            return False
        except Exception as e:  # a bug here must not leave the generation unwatched either
            if self.stopping:
                return False  # stopped meanwhile (its standbys killed under the handover): not a launch failure
            known = isinstance(e, (OSError, RuntimeError, asyncio.TimeoutError, psutil.Error))
            if not known:
                log.exception("handover failed", extra=self._ctx)
            await self._fail(-1, f"the standby workers could not take over: {e}",
                             FailureCause.LAUNCH_NODE if known else FailureCause.SUPERVISOR_ERROR)
            return False
        self.started_mono = time.monotonic()  # the ranks' start-up timeout counts from the handover
        return True

    async def stop(self, grace_s: float, stop_at: int = 0, reason: str = "", now: bool = False,
                   cause: FailureCause = FailureCause.NONE) -> list[int]:
        """Stop every process of this generation. Returns leftovers. ``reason``: why, for the
        report (else what the ranks' exits say); ``cause``: the report's cause (AGENT_SHUTDOWN:
        elasticd is stopping on request). ``now``: kill at once, even ranks already leaving and
        beside a planned stop under way (a fence must end within fencing.KILL_S).

        With ``grace_s`` > 0 (a planned stop) the ranks alone get SIGTERM first, after the step
        they stop at is in the stop file: ``stop_at``, which the coordinator chose for every
        member, or one this agent chooses when every rank is its own (else none: the ranks agree
        at their backstop). They checkpoint there and exit with the planned-exit code. msrun
        itself must not get it (it has no handler and dies; its workers die with it, unsaved).
        Whatever is left after the grace period is killed; it counts from the step they stop at
        (the one named, else the backstop they can next agree at), reached at the measured step
        rate: on a busy node the steps to it may take longer than the grace itself.
        """
        if self.phase is Phase.LEFT:  # (its shim has it, and the next elasticd)
            return []
        self._begin_stop()
        if (fenced := self.shim.fenced()) is not None:  # (its shim fenced it: that is why, whoever asks)
            reason, now = fenced, True
        if now:
            grace_s = 0
        if grace_s > 0 and not self.state.terminal:
            if not self.stop_at:  # told once: a Stop sent again must not move it
                if stop_at <= 0 and len(self.plan.members) == 1:
                    stop_at = self.next_stop_step()
                if stop_at > 0:
                    self.plan_stop(stop_at)
            # (The steps to the step they stop at, at the measured rate: the grace is for the
            # checkpoint and the exit, however slow the steps on a busy node.)
            grace_s += rank_rules.steps_to_go_s(self.stop_at, [rs.step for rs in self.ranks.values()],
                                                self.steps_per_s(), self.spec.stop_check_interval_steps,
                                                STEPS_TO_GO_MAX_S)
            await self._ask_ranks_to_stop(grace_s)
        elif not now and not self.state.terminal and any(rs.exit_step >= 0 for rs in self.ranks.values()):
            await self._wait_ranks_gone(min(self.spec.stop_grace_period_s, 2.0))  # they are leaving already
        left = await self.launch.teardown(grace_s=0)
        for proc in self.launch.launched():
            try:
                await within(proc.wait(), timeout=5)
            except asyncio.TimeoutError:
                left.append(proc.pid)
        self.stopped_at = self.stopped_at or time.time()
        if not self.state.terminal:
            self._drain_beats()
            self.exit_step = rank_rules.exit_step(self.ranks.values())
            if self.exit_step >= 0:  # (the step they named may not be the one they reached: say which)
                log.info("the ranks checkpointed at step %d and exited%s", self.exit_step,
                         f" (asked to stop at step {self.stop_at})" if self.stop_at not in (0, self.exit_step) else "",
                         extra=self._ctx)
            self.cause = cause
            self._set(GenerationState.STOPPED, reason=reason or (self._exit_reason(asked=grace_s > 0)
                      if self.exit_step >= 0 else "stopped on request"))
        self._close()
        if left:
            log.error("processes left after stop: %s", left, extra=self._ctx)
        return left

    def steps_per_s(self) -> float:
        """The highest local rank's step rate over its last few steps (0.0 before two steps)."""
        return rank_rules.steps_per_s(list(self._progress))

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
        try:
            write_stop_step(self.stop_file, step)
        except OSError as e:
            log.error("stop step %d not written to %s (%s): the ranks agree at their backstop", step,
                      self.stop_file, e.strerror or e, extra=self._ctx)
            return
        self.stop_at = step
        top = max(rs.step for rs in self.ranks.values())
        if top >= step:
            log.warning("stop step %d is not ahead of rank step %d: a rank already past it cannot stop there",
                        step, top, extra=self._ctx)
        else:
            log.info("the ranks are asked to stop at step %d (highest step now %d)", step, top, extra=self._ctx)

    async def _ask_ranks_to_stop(self, grace_s: float) -> None:
        self._signal_ranks()
        slow = await self._wait_ranks_gone(grace_s)
        if slow:
            log.warning("ranks %s did not exit within %.0fs of SIGTERM; killing", slow, grace_s, extra=self._ctx)

    def _signal_ranks(self) -> None:
        """SIGCONT (a stopped rank ignores SIGTERM) and SIGTERM to every live local rank."""
        self._discover()
        ranks = signal_ranks(self.ranks.values())
        log.info("asked ranks %s to checkpoint and exit%s", [r.rank for r in ranks],
                 f" at step {self.stop_at}" if self.stop_at else "", extra=self._ctx)

    async def _wait_ranks_gone(self, timeout_s: float) -> list[int]:
        """Wait for the ranks to exit, noting each one's exit code as it does (its pidfd turns
        readable as it exits: a zombie whose status is there to read before msrun reaps it);
        returns the ranks still running."""
        ranks = [rs for rs in self.ranks.values() if rs.pid]
        await procs.wait_ended([(rs.pid, rs.create_time) for rs in ranks], timeout_s, on_end=self._note_exit_codes)
        self._note_exit_codes()
        return [rs.rank for rs in ranks if procs.alive(rs.pid, rs.create_time)]

    def _note_exit_codes(self) -> None:
        self.launch.note_exit_codes(self.ranks.values())

    def _exit_reason(self, asked: bool) -> str:
        why = "on request" if asked else "on a SIGTERM not sent by the agent"
        return f"ranks checkpointed at step {self.exit_step} {why} and {rank_rules.exit_codes(self.ranks.values())}"

    def _drain_beats(self) -> None:
        """Read heartbeats still queued: a rank's planned-exit beat can arrive just before it is gone,
        and no await may have let the socket's reader run since."""
        if self._beats is not None:
            self._beats.read()

    def can_be_left(self) -> bool:
        """Whether the generation can go on without elasticd: watched, neither stopping nor over,
        not fenced, and either msrun under its shim (started cold, or adopted so) or (warm) every
        rank running, its shim guarding and its record written (:meth:`_record_warm`)."""
        if self.phase is not Phase.WATCHING or self.stopping or self.state.terminal or self.shim.fenced() is not None:
            return False
        if self.launch.msrun is not None:
            return (isinstance(self.launch.msrun, UnderShim) and self.launch.msrun.returncode is None
                    and not os.path.exists(self.shim.paths.exit))  # (msrun's end, not yet seen by asyncio)
        handles = self.launch.handles()
        return (self.warm and self._recorded and bool(self.launch.warm_ranks)
                and all(p.returncode is None for p in handles)
                and all(procs.alive(rs.pid, rs.create_time) for rs in self.ranks.values())
                and self.shim.proc is not None and self.shim.proc.returncode is None
                and (self.adopted or self.launch.server() is not None))

    def groups_kept(self) -> set[str]:
        """The cgroups (relative) a restart of elasticd keeps for this generation: its own and,
        warm, its fork server's (the ranks' parent)."""
        return {g for g in (self.launch.group.rel if self.launch.group is not None else "", self.server_group) if g}

    async def leave(self) -> None:
        """Leave the generation to its shim (elasticd is restarting: see agent.generation.adopt): nothing of it
        is signalled; the watch ends and elasticd's handles close; its shim's files, its stop file
        and its report (still RUNNING, with the step) stay for the next elasticd, which adopts it."""
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._drain_beats()
        self.shim.leave()
        what = (f"msrun pid {self.launch.msrun.pid}" if self.launch.msrun is not None else
                f"warm ranks {sorted(p.pid for p in self.launch.warm_ranks.values())}")
        self.launch.release()
        self._drop_handles(Phase.LEFT)
        log.info("generation left to its shim (pid %d), %s: the next elasticd adopts it",
                 self.shim.proc.pid if self.shim.proc is not None else -1, what, extra=self._ctx)

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.stop_file)
        self.shim.end()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._drop_handles(Phase.CLOSED)

    def _drop_handles(self, phase: Phase) -> None:
        """elasticd's handles on the generation closed (its log, the heartbeat socket, the exit
        watch), and nothing more: ``phase`` says why (over, or left to its shim)."""
        self.launch.close()
        if self._beats is not None:
            self._beats.close()
            self._beats = None
        self.exits.close()
        self.phase = phase
        self.done.set()

    # -- watching ----------------------------------------------------------

    def _received(self, beat: Beat, sender: int) -> None:
        """A beat from a process of this generation: counted for its rank when that rank's process
        sent it (a pid learnt from the kernel, if msrun's children did not say it yet)."""
        rs = self.ranks.get(beat.rank)
        if beat.pid != sender or (rs is not None and rs.pid and rs.pid != sender):
            metrics.FORGED_BEATS.inc()
            log.warning("heartbeat for rank %d claiming pid %d sent by pid %d: dropped", beat.rank, beat.pid,
                        sender, extra=self._ctx)
            return
        if rs is not None and not rs.pid and self.launch.msrun is not None:
            observe.learn_pid(self.launch.msrun.pid, rs, sender, self._seen)
        self.on_beat(beat)

    def on_beat(self, beat: Beat) -> None:
        """What a rank's beat says, for its rank and the generation (a beat counted: see :meth:`_received`)."""
        rs = self.ranks.get(beat.rank)
        if rs is None or beat.generation != self.plan.generation:
            log.warning("heartbeat from rank %d of generation %d ignored", beat.rank, beat.generation,
                        extra=self._ctx)
            return
        joined, top, now = rank_rules.joined(self.ranks.values()), max(r.step for r in self.ranks.values()), \
            time.monotonic()
        learned_before = self.learned.learned(learned_rules.STEP)
        rank_rules.note_beat(rs, beat, now, self.learned, self.spec.checkpoint_interval_steps)
        if not learned_before and not self.spec.hang_timeout_s and self.learned.learned(learned_rules.STEP):
            log.info("hang limits learned from the job: a stopped rank after %.1fs, the whole job idle after %.1fs "
                     "in a step (sections seen: %s)", self.learned.stopped_limit()[0],
                     self.learned.limit(learned_rules.STEP).idle_s,
                     ", ".join(f"{k} x{n} longest {t:.2f}s" for k, (n, t) in self.learned.summary().items()),
                     extra=self._ctx)
        if not joined and JOINED in rs.phase_at:
            self.on_joined(self)
        if beat.kind == BeatKind.PHASE:
            return
        if beat.step > top:
            self._progress.append((now, beat.step))
        if beat.kind == BeatKind.FATAL:
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

    async def watch(self) -> None:
        """Look, judge, act, until the generation ends: woken by a process's exit or every
        ``poll_interval_s``."""
        try:
            while not self.state.terminal and not self.stopping:
                self.exits.wake.clear()
                self._discover()
                if not self.done.is_set():
                    self.exits.watch(self.launch.handles(),
                                      [rs for rs in self.ranks.values() if rs.rank not in self.launch.warm_ranks])
                self._nudge()
                self._note_exit_codes()
                fault = self._find_fault()
                if fault is not None and rank_rules.exited_on_sigterm(self.ranks.values()):
                    await self._stopped_unasked()
                    return
                if fault is not None:
                    # Dead or hung, the collective is broken: kill at once and resume from the last
                    # committed checkpoint. (A SIGTERM to msrun's group here raced msrun's death,
                    # which kills the workers: sometimes they saved, sometimes not.)
                    await self._fail(*fault)
                    return
                if (code := self.launch.exit_code()) is not None:
                    await self._launch_exited(code)
                    return
                if await self.launch.only_the_scheduler_waits(list(self.ranks.values()), self.plan.master_port):
                    log.info("every rank finished and left the scheduler: the generation is done, "
                             "msrun and its scheduler stopped", extra=self._ctx)
                    await self._launch_exited(0)
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_s):
                        await self.exits.wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not leave workers unwatched
            log.exception("supervisor failed; tearing the generation down", extra=self._ctx)
            await self._fail(-1, "supervisor error", FailureCause.SUPERVISOR_ERROR)

    async def _fenced_by_shim(self) -> bool:
        """The shim fenced the generation (elasticd was held up past its deadline): stopped as a
        fence, not failed, and the node told (it fences as its own deadline says)."""
        why = self.shim.fenced()
        if why is not None:
            if not self.state.terminal:
                await self.stop(0, reason=why, now=True)
            self.on_fenced(why)
        return why is not None

    def _discover(self) -> None:
        """Learn each local rank's pid from msrun's direct children (warm: every rank is known from
        its handover)."""
        if self.launch.msrun is not None:
            observe.discover(self.launch.msrun.pid, self.ranks, self._seen, self.spec.script)

    def peer_joined(self) -> None:
        """A rank of this generation on another node got through ``init()`` (its agent said so:
        ``Agent.Nudge``): as good as a local peer for :meth:`_nudge`."""
        self._remote_joined_at = self._remote_joined_at or time.monotonic()

    def _nudge(self) -> None:
        """Wake a rank asleep in MindSpore's CPU collective address exchange once a peer got through
        ``init()`` (see ``contract.NUDGE_SIGNAL``): the addresses are all there by then. A local peer,
        or one on another node whose agent told us. Once per rank; a rank whose script does not
        handle the signal ignores it."""
        now = time.monotonic()
        for rs in rank_rules.to_nudge(self.ranks.values(), self._remote_joined_at, now, NUDGE_AFTER_S):
            if procs.alive(rs.pid, rs.create_time):
                rs.nudged = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rs.pid, contract.NUDGE_SIGNAL)
                log.info("rank %d still in init() after a peer got through: nudged out of MindSpore's 3 s "
                         "address poll", rs.rank, extra={**self._ctx, "rank": rs.rank})

    def _find_fault(self) -> tuple[int, str, FailureCause] | None:
        """(rank, reason, cause) of the rank that failed; None while all is well: one look
        (:meth:`_look`), judged by :func:`mselastic.agent.generation.verdict.judge`."""
        fault = verdict.judge(self._look(), self.timing)
        if fault is None:
            return None
        rs = self.ranks.get(fault.rank)
        if fault.cause is FailureCause.RANK_EXITED and rs is not None and rs.exit_code is None:
            rs.exit_code = self.launch.msrun_exits().get(rs.pid)  # (what the report says, as judged)
        return fault.rank, fault.reason, fault.cause

    def _look(self) -> verdict.Look:
        """One look at the ranks (see :func:`mselastic.agent.generation.observe.look`), the beats
        queued read first: an elasticd that could not run for a while (a loaded machine, a pause)
        must not take the beats it has not read yet for silence."""
        try:
            self._drain_beats()
        except Exception:  # (a beat that cannot be taken in must not end the watch: logged, as before)
            log.exception("heartbeats not read", extra=self._ctx)
        whole = self.member.local_workers == self.plan.world_size
        look = observe.look(self.ranks, time.monotonic(), self.started_mono, self.log_dir,
                            self.launch.warm_scheduler(), self.launch.msrun is not None, self.launch.msrun_exits,
                            self._drain_beats, whole)
        # (Only a single-node job's whole silence, with no hang_timeout_s, is looked at for work.)
        silent = whole and not self.spec.hang_timeout_s and verdict.all_past_idle(look, self.timing)
        group = self.launch.group
        idle = self._idle.look(look.now, silent and group is not None,
                               group.work if group is not None else lambda: None)
        return dataclasses.replace(look, idle=idle)

    async def _stopped_unasked(self) -> None:
        """The ranks exited on a SIGTERM this agent did not send (an operator, another node's
        rank: they all agree on the step). Nothing is lost; the coordinator relaunches."""
        self.detected_at = time.time()
        self._begin_stop()
        await self._wait_ranks_gone(min(self.spec.stop_grace_period_s, 2.0))
        self._drain_beats()
        self.exit_step = rank_rules.exit_step(self.ranks.values())
        self.reason = self._exit_reason(asked=False)
        log.warning("%s", self.reason, extra=self._ctx)
        left = await self.launch.teardown(grace_s=0)
        if left:
            log.error("processes left after the ranks' exit: %s", left, extra=self._ctx)
        self.stopped_at = time.time()
        self.cause = FailureCause.SIGTERM
        self._set(GenerationState.STOPPED)
        self._close()

    async def _fail(self, rank: int, reason: str, cause: FailureCause, grace_s: float = 0) -> None:
        if await self._fenced_by_shim():  # (what looks like a failure is the fence's kill)
            return
        self.detected_at = time.time()
        if rank in self.ranks and self.ranks[rank].last_beat:
            metrics.DETECTION.observe(time.monotonic() - self.ranks[rank].last_beat)
        self.failed_rank, self.reason, self.cause = rank, reason + self._oom_note(), cause
        log.warning("rank %d failed: %s; tearing down", rank, self.reason, extra={**self._ctx, "rank": rank})
        self._begin_stop()
        left = await self.launch.teardown(grace_s=grace_s)
        if left:
            log.error("processes left after teardown: %s", left, extra=self._ctx)
        self.stopped_at = time.time()
        if cause in (FailureCause.RANK_EXITED, FailureCause.RANK_HUNG, FailureCause.MSRUN_FAILED):
            await self._blame_device(rank)
        self._set(GenerationState.FAILED)
        self._close()

    async def _devices_pass(self) -> bool:
        """The device check of the member's devices (see agent.devices.health), before the launch;
        False once it failed the generation: cause DEVICE when the device was set aside (the
        relaunch takes another, the node keeps serving), else the node's (LAUNCH_NODE)."""
        if self.check_devices is None or not self.member.devices:
            return True
        kind = self.member.device_kind
        try:
            failed = await self.check_devices(self.member.devices, kind, self.user, self.launch.group)
        except Exception as e:  # noqa: BLE001 - etcd, a check that cannot run: the node's to answer for
            await self._fail(-1, f"the device check could not run: {e}", FailureCause.LAUNCH_NODE)
            return False
        if failed is None:
            return True
        device, why, aside = failed
        if aside:
            self.failed_device = device
            await self._fail(-1, f"{kind} device {device} failed its check ({why}); set aside", FailureCause.DEVICE)
        else:
            await self._fail(-1, f"{kind} device {device} failed its check ({why}); not set aside (see the node's "
                                 f"log)", FailureCause.LAUNCH_NODE)
        return False

    async def _blame_device(self, rank: int) -> None:
        """Ranks failed: when a device of this member shows it failed (see
        agent.devices.health.evidence), the failure is that device's (cause DEVICE, the node not
        blamed), set aside first."""
        if self.on_device_fault is None or not self.member.devices:
            return
        device, whose, why = await evidence(self.on_device_fault, self.member, rank - self.first_rank,
                                            os.path.join(self.log_dir, f"worker_{rank}.log"),
                                            {**self._ctx, "rank": rank})
        if why:
            self.cause, self.failed_device = FailureCause.DEVICE, device
            self.reason += f"; {whose}, {self.member.device_kind} {device}: {why}"

    def _oom_note(self) -> str:
        """What the failure's reason adds when the OOM killer ended processes of this generation (the
        kernel counts them in the cgroup of the process it killed, v2 in its parents' too)."""
        if self.launch.group is None or (kills := self.launch.group.oom_kills()) <= 0:
            return ""
        return (f"; the kernel's OOM killer ended {kills} process(es) of this job on {self.node_id}: it is over "
                f"its memory limit here ({self.limits.memory_bytes // 2**20} MiB; memory_limit_mb)")

    async def _launch_exited(self, code: int) -> None:
        """msrun exited (cold), or every rank did (warm: the scheduler leaves once they are gone)."""
        if await self._fenced_by_shim():
            return
        if code == 0 and self.adopted and not all(r.finished for r in self.ranks.values()):
            # (msrun exits 0 only once every worker did; the last beats of those that ended while
            # no elasticd ran went to no one: they finished. One seen to exit is judged as ever.)
            log.info("msrun exited 0: the ranks not seen to end finished while no elasticd ran", extra=self._ctx)
            for rs in self.ranks.values():
                rs.finished = rs.finished or rs.exit_code is None
        if code == 0 and all(r.finished for r in self.ranks.values()):
            self._set(GenerationState.SUCCEEDED)
            left = await self.launch.teardown(grace_s=1)
            if left:
                log.error("processes left after success: %s", left, extra=self._ctx)
            self._close()
            return
        who = "msrun" if self.launch.msrun is not None else "the ranks"
        culprit = self.worker_msrun_saw_die() if code else None
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

    def worker_msrun_saw_die(self) -> tuple[int, int, str] | None:
        """(rank, pid, how) of the worker msrun's log says exited with an error, when this agent did not
        see it die (msrun exits at once on n1 and the like, with no scheduler to wait for; this
        agent's poll may have been held up, on a busy node, until after both); see
        :func:`mselastic.agent.generation.ranks.blame_from_msrun`."""
        blamed = rank_rules.blame_from_msrun(self.ranks.values(), self.launch.msrun_exits())
        if blamed is None:
            return None
        rs, pid, code = blamed
        rs.exit_code = code
        return rs.rank, pid, verdict.exit_status(code)

    def _ranks_seen(self) -> str:
        return rank_rules.seen(self.ranks.values(), lambda rs: procs.alive(rs.pid, rs.create_time))

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
            warm=self.warm, devices=self.member.devices, failed_device=self.failed_device, adoptions=self.adoptions)
