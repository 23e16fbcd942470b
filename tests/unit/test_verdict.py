"""The agent's verdict on a generation (mselastic.agent.generation.verdict.judge) as a table: one row per
fault of the failure matrix that an agent sees on its own node, and the looks that are no fault.
No process is started: each row is one look, written out."""

from __future__ import annotations

import pytest

from mselastic.agent.generation.learned import (CHECKPOINT, FALLBACK_S, FIRST_STEP, IDLE_FLOOR_S, MAX_SECTIONS, MIN_STEPS,
                                                SAFETY, STEP, STOPPED_FLOOR_S, WINDOW, Learned, busy)
from mselastic.agent.generation.verdict import Fault, Look, RankLook, Timing, judge
from mselastic.core.contract import Beat
from mselastic.core.states import FailureCause as C

NOW = 1000.0
T = Timing(hang_timeout_s=60, startup_timeout_s=180, stop_grace_period_s=5)
STEPPING = len(Beat.PHASES) - 1  # every start-up phase passed


def rank(r: int, **kw: object) -> RankLook:
    fields: dict[str, object] = dict(pid=100 + r, last_beat=NOW - 0.5, phase=STEPPING)
    fields.update(kw)
    return RankLook(rank=r, **fields)  # type: ignore[arg-type]


def look(*ranks: RankLook, **kw: object) -> Look:
    return Look(now=NOW, ranks={r.rank: r for r in ranks}, started=NOW - 30, **kw)  # type: ignore[arg-type]


ROWS: list[tuple[str, Look, tuple[int, C, str] | None]] = [
    ("healthy", look(rank(0), rank(1)), None),
    ("a rank SIGKILLed", look(rank(0), rank(1, dead=True, exit_code=-9)),
     (1, C.RANK_EXITED, "exited before finishing (pid 101, killed by SIGKILL)")),
    ("a rank exits non-zero, its exit status not seen", look(rank(0), rank(1, dead=True)),
     (1, C.RANK_EXITED, "exit status not seen")),
    ("two dead: the one msrun reaped first is blamed, not the lower rank",
     look(rank(0, dead=True, last_beat=NOW - 2), rank(1, dead=True, reaped=True, exit_code=1, last_beat=NOW - 1)),
     (1, C.RANK_EXITED, "exit code 1")),
    ("two dead, neither reaped: the one silent longest", look(rank(0, dead=True, last_beat=NOW - 1),
                                                            rank(1, dead=True, last_beat=NOW - 3)),
     (1, C.RANK_EXITED, "exited before finishing")),
    ("two dead before any beat, both reaped: the one msrun did not SIGKILL",
     look(rank(0, dead=True, reaped=True, exit_code=-9, last_beat=0), rank(1, dead=True, reaped=True, exit_code=1,
                                                                          last_beat=0)),
     (1, C.RANK_EXITED, "exit code 1")),
    ("two dead after beats: the one silent longest, though msrun SIGKILLed it (the OOM killer's, say)",
     look(rank(0, dead=True, reaped=True, exit_code=-9, last_beat=NOW - 3), rank(1, dead=True, reaped=True, exit_code=1,
                                                                               last_beat=NOW - 1)),
     (0, C.RANK_EXITED, "killed by SIGKILL")),
    ("a rank says it cannot go on, then exits", look(rank(0, dead=True, fatal="checkpoint unreadable"), rank(1)),
     (0, C.TRAINER_FATAL, "cannot go on: checkpoint unreadable")),
    ("a rank that finished and exited is no fault", look(rank(0, dead=True, finished=True), rank(1)), None),
    ("every rank checkpointed on a SIGTERM and exited",
     look(rank(0, dead=True, exit_step=13), rank(1, dead=True, exit_step=13)),
     (0, C.SIGTERM, "checkpointed at step 13 on a SIGTERM")),
    ("one rank's planned exit, the other still within the grace period",
     look(rank(0, dead=True, exit_step=13, last_beat=NOW - 1), rank(1)), None),
    ("... and past it", look(rank(0, dead=True, exit_step=13, last_beat=NOW - 6), rank(1)),
     (0, C.SIGTERM, "on a SIGTERM")),
    ("the warm scheduler exits while ranks run", look(rank(0), rank(1), scheduler_exit=1, scheduler_pid=7),
     (-1, C.MSRUN_FAILED, "the scheduler (standby pid 7) exited with code 1")),
    ("the warm scheduler exits once every rank finished", look(rank(0, finished=True), rank(1, finished=True),
                                                              scheduler_exit=0), None),
    ("a rank SIGSTOPped for half the hang timeout", look(rank(0), rank(1, stopped_since=NOW - 30)),
     (1, C.RANK_HUNG, "stopped (state T, pid 101) for 30.0s")),
    ("a rank SIGSTOPped for less", look(rank(0), rank(1, stopped_since=NOW - 10)), None),
    ("a rank stuck in init() long after its peer got through",
     look(rank(0, phase=1, phase_at={1: NOW - 61}), rank(1, phase=0)),
     (1, C.RANK_HUNG, f"stuck in {Beat.PHASES[0]} for 61.0s after rank 0 got past it")),
    ("a rank without a heartbeat for the hang timeout", look(rank(0), rank(1, last_beat=NOW - 61)),
     (1, C.RANK_HUNG, "no heartbeat for 61.0s")),
    ("a rank that never beat, past the start-up timeout",
     Look(now=NOW, ranks={0: rank(0), 1: rank(1, last_beat=0.0, phase=-1)}, started=NOW - 181),
     (1, C.RANK_NEVER_STARTED, "no heartbeat within startup_timeout_s=180")),
    ("a rank that never beat, within the start-up timeout",
     Look(now=NOW, ranks={0: rank(0), 1: rank(1, last_beat=0.0, phase=-1)}, started=NOW - 100), None),
]


def judged_as(seen: Look, timing: Timing, expected: tuple[int, C, str] | None) -> None:
    fault = judge(seen, timing)
    if expected is None:
        assert fault is None, fault
    else:
        assert isinstance(fault, Fault) and (fault.rank, fault.cause) == expected[:2], fault
        assert expected[2] in fault.reason, fault.reason


@pytest.mark.parametrize("what, seen, expected", ROWS, ids=[r[0] for r in ROWS])
def test_judge(what: str, seen: Look, expected: tuple[int, C, str] | None) -> None:
    judged_as(seen, T, expected)


# -- limits learned from the job (#47: no hang_timeout_s in the spec) ------------------------------

def seasoned() -> Learned:
    """A job seen for a while: 0.1 s steps (one of 0.3 s), 2 s saves, a 10 s first step, 5 s evaluations."""
    seen = Learned(startup_timeout_s=180)
    for i in range(40):
        seen.observe(STEP, 0.3 if i == 7 else 0.1)
    seen.observe(CHECKPOINT, 2.0)
    seen.observe(FIRST_STEP, 10.0)
    seen.observe("eval", 5.0)
    return seen


LEARNED = Timing(hang_timeout_s=0, startup_timeout_s=180, stop_grace_period_s=5, learned=seasoned())
FRESH = Timing(hang_timeout_s=0, startup_timeout_s=180, stop_grace_period_s=5, learned=Learned(180))
EXPLICIT = Timing(hang_timeout_s=60, startup_timeout_s=180, stop_grace_period_s=5, learned=seasoned())

def whole(*ranks: RankLook, idle: bool | None = True) -> Look:
    """A look at a single-node job (every rank of it is here) whose cgroup was seen ``idle``."""
    return Look(now=NOW, ranks={r.rank: r for r in ranks}, started=NOW - 30, whole=True, idle=idle)


def silent(r: int, silent_s: float, section: str = STEP, **kw: object) -> RankLook:
    return rank(r, last_beat=NOW - silent_s, section=section, **kw)


LEARNED_ROWS: list[tuple[str, Timing, Look, tuple[int, C, str] | None]] = [
    ("stopped for ten typical steps (at least 1 s)", LEARNED, look(rank(0), rank(1, stopped_since=NOW - 1.1)),
     (1, C.RANK_HUNG, "learned: 10 typical steps (0.10s)")),
    ("stopped for less", LEARNED, look(rank(0), rank(1, stopped_since=NOW - 0.8)), None),
    ("a debugger's stop (state t): half the default", LEARNED,
     look(rank(0), rank(1, stopped_since=NOW - 29, traced=True)), None),
    ("... past it", LEARNED, look(rank(0), rank(1, stopped_since=NOW - 31, traced=True)),
     (1, C.RANK_HUNG, "half of the default=60, a tracing stop")),
    ("stopped, steps not learned yet: half the default", FRESH, look(rank(0), rank(1, stopped_since=NOW - 29)), None),
    ("... past it", FRESH, look(rank(0), rank(1, stopped_since=NOW - 31)), (1, C.RANK_HUNG, "half the default, 30s")),
    ("the whole job silent past its limit (the floor) and idle (a deadlock): the one silent longest", LEARNED,
     whole(silent(0, 30.5), silent(1, 30.6)),
     (1, C.RANK_HUNG, "no heartbeat for 30.6s in step, the whole job idle (learned: 4x the longest step seen "
                      "here, 0.30s; idle at least 30s, else at least 60s)")),
    ("... its cgroup not looked at yet", LEARNED, whole(silent(0, 30.5), silent(1, 30.6), idle=None), None),
    ("... its cgroup working (an evaluation, a data loader's workers, a save)", LEARNED,
     whole(silent(0, 40), silent(1, 40), idle=False), None),
    ("... one rank still within its limit", LEARNED, whole(rank(0), silent(1, 40)), None),
    ("... one rank finished: the others judged", LEARNED, whole(rank(0, finished=True), silent(1, 31)),
     (1, C.RANK_HUNG, "the whole job idle")),
    ("... ranks on other nodes (they may be working): the default", LEARNED,
     look(silent(0, 59), silent(1, 59), idle=True), None),
    ("... past it", LEARNED, look(silent(0, 59), silent(1, 61), idle=True),
     (1, C.RANK_HUNG, "no heartbeat for 61.0s in step (")),
    ("working past the default", LEARNED, whole(rank(0), silent(1, 61), idle=False), (1, C.RANK_HUNG, "in step (learned")),
    ("in a save, idle, within 4x the longest save (the floor)", LEARNED,
     whole(silent(0, 29, CHECKPOINT), silent(1, 29, CHECKPOINT)), None),
    ("a first step (a compile), idle, within 4x the longest", LEARNED,
     whole(silent(0, 39, FIRST_STEP), silent(1, 39, FIRST_STEP)), None),
    ("... past it", LEARNED, whole(silent(0, 41, FIRST_STEP), silent(1, 41, FIRST_STEP)),
     (0, C.RANK_HUNG, "in first_step, the whole job idle (learned: 4x the longest first_step seen here, 10.00s; idle")),
    ("an evaluation marked, idle, within the floor", LEARNED, whole(silent(0, 29, "eval"), silent(1, 29, "eval")),
     None),
    ("a section never seen: the default", LEARNED, whole(silent(0, 59, "export"), silent(1, 59, "export")), None),
    ("... past it", LEARNED, whole(silent(0, 61, "export"), silent(1, 59, "export")),
     (0, C.RANK_HUNG, "export not learned yet: the default, 60s")),
    ("a job's first step, nothing learned: startup_timeout_s", FRESH,
     whole(silent(0, 170, FIRST_STEP), silent(1, 170, FIRST_STEP)), None),
    ("a job's steps before 20 of them: the default", FRESH, whole(silent(0, 59), silent(1, 59)), None),
    ("an explicit hang_timeout_s wins over what was learned", EXPLICIT,
     whole(silent(0, 30), silent(1, 30), rank(2, stopped_since=NOW - 20)), None),
    ("... its value", EXPLICIT, whole(rank(0), silent(1, 61), idle=False), (1, C.RANK_HUNG, "(hang_timeout_s=60)")),
]


@pytest.mark.parametrize("what, timing, seen, expected", LEARNED_ROWS, ids=[r[0] for r in LEARNED_ROWS])
def test_judge_learned(what: str, timing: Timing, seen: Look, expected: tuple[int, C, str] | None) -> None:
    judged_as(seen, timing, expected)


def test_what_is_learned_and_what_is_not() -> None:
    seen = Learned(startup_timeout_s=120)
    assert seen.limit(FIRST_STEP).idle_s == 120 and seen.limit(STEP).idle_s == FALLBACK_S
    for _ in range(MIN_STEPS - 1):
        seen.observe(STEP, 0.05)
    assert not seen.learned(STEP) and seen.typical_step_s() is None
    seen.observe(STEP, 0.05)
    assert seen.learned(STEP) and seen.typical_step_s() == pytest.approx(0.05)
    assert seen.limit(STEP).idle_s == IDLE_FLOOR_S and seen.limit(STEP).busy_s == FALLBACK_S  # (never below the floor)
    assert seen.stopped_limit()[0] == STOPPED_FLOOR_S
    seen.observe(STEP, 30.0)  # one long pause: the limit follows the longest, and stays there
    for _ in range(WINDOW):
        seen.observe(STEP, 0.05)
    assert seen.limit(STEP).idle_s == SAFETY * 30 and seen.limit(STEP).busy_s == SAFETY * 30
    seen.observe(STEP, -1.0)  # (a clock stepped back) is not a duration
    assert seen.summary()[STEP][0] == MIN_STEPS + 1 + WINDOW
    for i in range(MAX_SECTIONS + 5):  # a script naming a section per step does not grow elasticd
        seen.observe(f"s{i}", 1.0)
    assert len(seen.summary()) == MAX_SECTIONS
    seen.observe(CHECKPOINT, 1.0)  # (the library's own are always kept)
    assert seen.learned(CHECKPOINT)


def test_a_generation_that_works_through_its_silence_is_busy() -> None:
    assert busy(work_s=0.2, over_s=0.5)       # an evaluation pass on a core, or a wait for one
    assert not busy(work_s=0.03, over_s=0.5)  # a collective that will never complete
    assert not busy(work_s=1.0, over_s=0.0)
