"""The agent's verdict on a running generation: a pure function of one look at its ranks.

:class:`Generation` observes (process states, exit codes, the ranks' beats, msrun's log, the
warm scheduler) and acts; what the look means is decided here, by :func:`judge`, which reads no
clock, no ``/proc`` and no socket, so every rule of the failure matrix is tested as a table
(``tests/unit/test_verdict.py``) without starting a process.
"""

from __future__ import annotations

import dataclasses
import signal

from mselastic.agent.generation import learned as learned_rules
from mselastic.core.contract import Beat
from mselastic.core.states import FailureCause


def exit_status(code: int) -> str:
    """"exit code 1", or "killed by SIGKILL" for a negative (subprocess) return code."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


@dataclasses.dataclass(frozen=True)
class RankLook:
    """One rank as one look saw it."""

    rank: int
    pid: int = 0
    #: Its process is gone or a zombie (only asked of a rank whose pid is known).
    dead: bool = False
    #: ... and gone from the process table: its parent (msrun) reaped it.
    reaped: bool = False
    #: Its exit code as far as it is known: seen before msrun reaped it, or read from msrun's log.
    exit_code: int | None = None
    last_beat: float = 0.0  # monotonic
    finished: bool = False
    #: The step it checkpointed at before a planned exit (-1: none).
    exit_step: int = -1
    #: Why it cannot go on (its fatal beat), "" if it did not say.
    fatal: str = ""
    #: Since when it is seen stopped (state T); 0 while it is not.
    stopped_since: float = 0.0
    #: Start-up phases reached (an index into Beat.PHASES), and when.
    phase: int = -1
    phase_at: dict[int, float] = dataclasses.field(default_factory=dict)
    #: What it does since its last beat (a section: mselastic.agent.generation.learned).
    section: str = ""
    #: Its stop (``stopped_since``) is a tracing stop (state t: a debugger, py-spy), not SIGSTOP.
    traced: bool = False


@dataclasses.dataclass(frozen=True)
class Look:
    """One look at a generation."""

    now: float  # monotonic
    ranks: dict[int, RankLook]
    #: When the generation was launched (monotonic).
    started: float
    #: The warm path's scheduler (a standby) exited with this code (None: running, or cold).
    scheduler_exit: int | None = None
    scheduler_pid: int = 0
    log_dir: str = ""
    #: Every rank of the job is one of these (a single-node job): only then can the agent see that
    #: nothing of the job works (see mselastic.agent.generation.learned).
    whole: bool = False
    #: While every rank is silent past its idle limit: whether the generation's cgroup did no work
    #: over the last window (no CPU time, no wait for a CPU or on I/O); None: not known.
    idle: bool | None = None


@dataclasses.dataclass(frozen=True)
class Timing:
    #: The spec's; 0: none, the limits are learned (``learned``).
    hang_timeout_s: float
    startup_timeout_s: float
    stop_grace_period_s: float
    learned: learned_rules.Learned | None = None

    @property
    def fixed_s(self) -> float:
        """The fixed limit: the spec's ``hang_timeout_s``, else the default before anything is learned."""
        return self.hang_timeout_s or learned_rules.FALLBACK_S

    def silence(self, section: str) -> learned_rules.Limit:
        """How long a rank in ``section`` may go without a beat."""
        if self.hang_timeout_s or self.learned is None:
            return learned_rules.Limit(self.fixed_s, self.fixed_s, f"hang_timeout_s={self.fixed_s:g}")
        return self.learned.limit(section or learned_rules.STEP)

    def stopped(self, traced: bool = False) -> tuple[float, str]:
        """How long a rank may stay stopped (state T; ``traced``: t, a debugger's), and why."""
        if self.hang_timeout_s or self.learned is None or traced:
            return self.fixed_s / 2, f"half of {'hang_timeout_s' if self.hang_timeout_s else 'the default'}=" \
                f"{self.fixed_s:g}" + (", a tracing stop" if traced else "")
        return self.learned.stopped_limit()

    @property
    def phase_s(self) -> float:
        """How long a rank may stay in a start-up phase a peer passed (not learned: rare)."""
        return self.fixed_s


@dataclasses.dataclass(frozen=True)
class Fault:
    """The rank blamed (-1: none in particular), why, and the cause."""

    rank: int
    reason: str
    cause: FailureCause


def how_exited(r: RankLook) -> str:
    """The exit code or signal of a rank, as far as it was seen."""
    if r.exit_code is None:
        return f"pid {r.pid}; exit status not seen, its parent reaped it first"
    return f"pid {r.pid}, {exit_status(r.exit_code)}"


def behind(look: Look) -> tuple[RankLook, RankLook, float] | None:
    """A rank still short of a start-up phase (``Beat.PHASES``) that a peer passed longest ago:
    (the rank, the peer, seconds since the peer passed it). Only the phases count: after
    ``init()`` the ranks load checkpoints and data at their own pace."""
    worst = None
    for r in look.ranks.values():
        if r.phase + 1 >= len(Beat.PHASES):
            continue
        ahead = [(peer.phase_at[r.phase + 1], peer) for peer in look.ranks.values()
                 if peer.phase > r.phase and r.phase + 1 in peer.phase_at]
        if ahead and not r.finished:
            since, peer = min(ahead, key=lambda a: (a[0], a[1].rank))
            if worst is None or since < worst[2] or (since == worst[2] and r.rank < worst[0].rank):
                worst = (r, peer, since)
    return None if worst is None else (worst[0], worst[1], look.now - worst[2])


def all_past_idle(look: Look, t: Timing) -> bool:
    """Every rank not finished has beaten and is silent past its section's idle limit."""
    running = [r for r in look.ranks.values() if not r.finished]
    return bool(running) and all(r.last_beat and look.now - r.last_beat > t.silence(r.section).idle_s
                                 for r in running)


def judge(look: Look, t: Timing) -> Fault | None:
    """The rank that failed, and why; None while all is well. In order:

    - a rank dead without having finished or announced a planned exit: the one that said it cannot
      go on (fatal), else one msrun reaped already (msrun SIGKILLs the others about a second after
      one exits and leaves them zombies), else the one silent longest (of those silent as long,
      as before any beat: one not seen killed by SIGKILL, msrun's kill of the others), else the
      lowest rank;
    - ranks that announced a planned exit (they checkpointed on a SIGTERM): once every rank has, or
      the others stayed silent for ``stop_grace_period_s``;
    - the warm scheduler gone while ranks run (msrun would notice only through its workers);
    - a rank stopped (state T) for half of ``hang_timeout_s`` (learned: a few typical steps), before
      its first step too: its peers stop beating about as early, waiting for it in a collective;
    - a rank stuck in a start-up phase ``hang_timeout_s`` (learned: the default) after a peer got past it;
    - a rank without a heartbeat for ``hang_timeout_s``; without one in the spec, for the limit
      learned for what it was doing (its section: mselastic.agent.generation.learned) once every
      rank of the job is here and each is seen silent and idle past its own, else for the longer
      of that limit and the default;
    - a rank without any heartbeat ``startup_timeout_s`` after the launch.
    """
    ranks = look.ranks.values()
    dead = [r for r in ranks if not r.finished and r.exit_step < 0 and r.pid and r.dead]
    if dead:
        fatal = [r for r in ranks if r.fatal]
        if fatal:
            first = min(fatal, key=lambda r: r.rank)
            return Fault(first.rank, f"cannot go on: {first.fatal}", FailureCause.TRAINER_FATAL)
        first = min([r for r in dead if r.reaped] or dead,
                    key=lambda r: (r.last_beat, r.exit_code == -signal.SIGKILL, r.rank))
        return Fault(first.rank, f"exited before finishing ({how_exited(first)})", FailureCause.RANK_EXITED)
    exited = [r for r in ranks if r.exit_step >= 0]
    if exited:
        pending = [r for r in ranks if r.exit_step < 0 and not r.finished]
        if not pending or look.now - max(r.last_beat for r in exited) > t.stop_grace_period_s:
            first = exited[0]
            return Fault(first.rank, f"checkpointed at step {first.exit_step} on a SIGTERM and exited (pid {first.pid})",
                         FailureCause.SIGTERM)
        return None
    if look.scheduler_exit is not None and not all(r.finished for r in ranks):
        return Fault(-1, f"the scheduler (standby pid {look.scheduler_pid}) exited with code {look.scheduler_exit} "
                         f"while the ranks ran; see {look.log_dir}/scheduler.log", FailureCause.MSRUN_FAILED)
    stopped = [r for r in ranks if r.stopped_since and not r.finished]
    if stopped:
        first = min(stopped, key=lambda r: (r.stopped_since, r.rank))
        limit, why = t.stopped(first.traced)
        if look.now - first.stopped_since >= limit:
            return Fault(first.rank, f"stopped (state T, pid {first.pid}) for {look.now - first.stopped_since:.1f}s "
                                     f"({why})", FailureCause.RANK_HUNG)
        return None
    late = behind(look)
    if late is not None and late[2] > t.phase_s:
        r, peer, for_s = late
        where = Beat.PHASES[r.phase] if r.phase >= 0 else "start-up (before init())"
        return Fault(r.rank, f"stuck in {where} for {for_s:.1f}s after rank {peer.rank} got past it "
                             f"({'hang_timeout_s' if t.hang_timeout_s else 'the default'}={t.phase_s:g})",
                     FailureCause.RANK_HUNG)
    running = [r for r in ranks if not r.finished]
    limits = {r.rank: t.silence(r.section) for r in running}
    all_idle = look.whole and look.idle is True and all_past_idle(look, t)
    silent = [r for r in running if r.last_beat and (look.now - r.last_beat > limits[r.rank].busy_s or all_idle)]
    if silent:
        first = min(silent, key=lambda r: (r.last_beat, r.rank))
        where = first.section or learned_rules.STEP
        how = "" if t.hang_timeout_s else f" in {where}, the whole job idle" if all_idle else f" in {where}"
        return Fault(first.rank, f"no heartbeat for {look.now - first.last_beat:.1f}s{how} ({limits[first.rank].why})",
                     FailureCause.RANK_HUNG)
    for r in ranks:
        if not r.last_beat and look.now - look.started > t.startup_timeout_s:
            return Fault(r.rank, f"no heartbeat within startup_timeout_s={t.startup_timeout_s:g}",
                         FailureCause.RANK_NEVER_STARTED)
    return None
