"""Each local rank's life as the agent knows it (:class:`RankState`), and the pure rules that
update it from a beat and sum the ranks up (the step they exited at, their exit codes, the step rate)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from mselastic.agent.generation import learned
from mselastic.core import contract
from mselastic.core.contract import Beat, BeatKind

#: The start-up phase a rank is in once it got through ``init()``.
JOINED = Beat.PHASES.index("joined")


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
    #: What it is doing since its last beat (a section of mselastic.agent.generation.learned; "":
    #: not started), the section a named one of the script's interrupted, and when that beat was
    #: sent (the rank's monotonic clock, else its wall clock, for beats of an older trainer).
    section: str = ""
    section_before: str = ""
    sent_at: float = 0.0


def reach(rs: RankState, phase: int, now: float) -> None:
    """``rs`` got to start-up ``phase`` (and past every one before it) at ``now``."""
    for p in range(rs.phase + 1, phase + 1):
        rs.phase_at.setdefault(p, now)
    rs.phase = max(rs.phase, phase)


#: What a beat's kind says the rank does next (the other kinds leave its section as it was).
_NEXT_SECTION: dict[BeatKind, str] = {BeatKind.START: learned.FIRST_STEP, BeatKind.STEP: learned.STEP, BeatKind.CHECKPOINT: learned.CHECKPOINT}


def note_beat(rs: RankState, beat: Beat, now: float, seen: learned.Learned | None = None,
              checkpoint_every: int = 0) -> None:
    """What one of its beats, received at ``now``, says of ``rs``; the time the rank spent in the
    section this beat ends goes to ``seen`` (timed on the rank's own monotonic clock: the beats'
    ``mono``, else their ``at``, so that beats read late by a busy elasticd are not taken for slow
    steps). A step crossing a multiple of ``checkpoint_every`` (as the trainer library saves) begins the
    checkpoint section; a named section ends back in the one it interrupted. A phase beat is start-up
    progress, not a heartbeat (``init()`` may wait long for other nodes); any other beat comes
    after the start-up phases."""
    if beat.kind == BeatKind.PHASE:
        if beat.note in Beat.PHASES:
            reach(rs, Beat.PHASES.index(beat.note), now)
        return
    reach(rs, len(Beat.PHASES), now)
    sent = beat.mono or beat.at
    if seen is not None and rs.section and rs.sent_at and sent >= rs.sent_at:
        seen.observe(rs.section, sent - rs.sent_at)
    named = rs.section not in ("", *_NEXT_SECTION.values())
    if beat.kind == BeatKind.SECTION:
        if beat.note and not named:
            rs.section_before = rs.section
        rs.section = beat.note[:learned.MAX_NAME] if beat.note else (rs.section_before or learned.STEP)
    elif beat.kind == BeatKind.STEP and checkpoint_every > 0 and rs.step >= 0 and \
            beat.step // checkpoint_every > rs.step // checkpoint_every:  # (as the trainer saves)
        rs.section = learned.CHECKPOINT
    else:
        rs.section = _NEXT_SECTION.get(BeatKind(beat.kind), rs.section)
    rs.sent_at = sent
    rs.last_beat = now
    rs.step = max(rs.step, beat.step)
    if beat.kind == BeatKind.STEP or (beat.kind == BeatKind.FINISHED and beat.loss):
        rs.loss = beat.loss  # (the other beats carry none: a stop's must not turn the last loss into 0)
    if beat.kind == BeatKind.START:
        rs.resumed_step = beat.resumed_step
    elif beat.kind == BeatKind.FATAL:
        rs.fatal = beat.note or "no reason given"
    elif beat.kind == BeatKind.FINISHED:
        rs.finished = True
    elif beat.kind == BeatKind.PLANNED_EXIT:
        rs.exit_step = beat.step


def joined(ranks: Iterable[RankState]) -> list[float]:
    """When each rank that got through ``init()`` did."""
    return [rs.phase_at[JOINED] for rs in ranks if JOINED in rs.phase_at]


def exit_step(ranks: Iterable[RankState]) -> int:
    """The step every rank checkpointed at before its planned exit; -1 if they did not all."""
    steps = {rs.exit_step for rs in ranks}
    return steps.pop() if len(steps) == 1 and -1 not in steps else -1


def exited_on_sigterm(ranks: Iterable[RankState]) -> bool:
    """Every rank checkpointed on a SIGTERM and has exited (or is exiting)."""
    ranks = list(ranks)
    return all(rs.exit_step >= 0 or rs.finished for rs in ranks) and exit_step(ranks) >= 0


def exit_codes(ranks: Iterable[RankState]) -> str:
    """The ranks' exit codes as seen, for a report's reason."""
    codes = sorted({rs.exit_code for rs in ranks if rs.exit_code is not None})
    if codes:
        return f"exited with code {', '.join(map(str, codes))}"
    return f"exited (announced code {contract.PLANNED_EXIT_CODE}; reaped by msrun before the agent saw it)"


def steps_per_s(progress: list[tuple[float, int]]) -> float:
    """The step rate over (time, highest step) samples, oldest first (0.0 before two)."""
    if len(progress) < 2:
        return 0.0
    (t0, s0), (t1, s1) = progress[0], progress[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0


def steps_to_go_s(stop_at: int, steps: Iterable[int], rate: float, backstop_steps: int, most_s: float) -> float:
    """How long ranks at ``steps`` (-1: not said) take at ``rate`` to reach the step they stop at:
    ``stop_at`` counted from the slowest rank that said its step, at most ``most_s``; with no step
    named (0), their backstop ``backstop_steps`` ahead. 0.0 while the rate is not known."""
    if rate <= 0:
        return 0.0
    if not stop_at:
        return backstop_steps / rate
    known = [s for s in steps if s >= 0]
    behind = stop_at - min(known) if known else 0
    return min(max(0, behind) / rate, most_s)


def to_nudge(ranks: Iterable[RankState], remote_joined_at: float, now: float, after_s: float) -> list[RankState]:
    """The ranks still in MindSpore's CPU collective address exchange ``after_s`` after a peer got
    through ``init()`` (a local one, or one on another node at ``remote_joined_at``; 0: none), not
    nudged yet; their pids are known."""
    ranks = list(ranks)
    through = joined(ranks) + ([remote_joined_at] if remote_joined_at else [])
    if not through or now - min(through) < after_s:
        return []
    return [rs for rs in ranks if rs.phase == JOINED - 1 and not rs.nudged and rs.pid]


def blame_from_msrun(ranks: Iterable[RankState], exits: dict[int, int]) -> tuple[RankState, int, int] | None:
    """(rank, pid, exit code) of the worker msrun's log says exited with an error (``exits``: pid ->
    code): the rank with that pid, else the only one whose pid was never learned; None when the
    log names none of them (msrun failed by itself)."""
    ranks = list(ranks)
    unknown = [rs for rs in ranks if not rs.pid and not rs.finished]
    for pid, code in exits.items():
        rs = next((r for r in ranks if r.pid == pid), None) or (unknown[0] if len(unknown) == 1 else None)
        if rs is not None:
            return rs, pid, code
    return None


def seen(ranks: Iterable[RankState], alive: Callable[[RankState], bool]) -> str:
    """Each rank as last seen (for a log line when msrun tells first)."""
    def state(rs: RankState) -> str:
        if rs.finished:
            return "finished"
        return "alive" if rs.pid and alive(rs) else "gone"

    return "; ".join(f"rank {rs.rank}: pid {rs.pid or '?'}, {state(rs)}, step {rs.step}" for rs in ranks)
