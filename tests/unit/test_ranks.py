"""What a rank's beats say of it (mselastic.agent.generation.ranks), as a table. No processes."""

from __future__ import annotations

import pytest

from mselastic.agent.generation import learned, ranks
from mselastic.core.contract import Beat, BeatKind


def beat(kind: str, step: int, loss: float = 0.0, **kw: object) -> Beat:
    return Beat(kind=kind, rank=0, pid=1, generation=1, step=step, loss=loss, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("last, loss", [
    (beat(BeatKind.PLANNED_EXIT, 12), 0.25),  # a planned stop says no loss: the last step's stays
    (beat(BeatKind.STOP_REQUESTED, 12), 0.25),
    (beat(BeatKind.FINISHED, 12), 0.25),
    (beat(BeatKind.FINISHED, 12, 0.125), 0.125),
    (beat(BeatKind.STEP, 13, 0.5), 0.5),
])
def test_the_loss_shown_is_the_last_steps(last: Beat, loss: float) -> None:
    rs = ranks.RankState(0)
    ranks.note_beat(rs, beat(BeatKind.STEP, 12, 0.25), now=1.0)
    ranks.note_beat(rs, last, now=2.0)
    assert rs.loss == loss and rs.step == last.step


def test_exit_step_and_exit_codes_sum_the_ranks_up() -> None:
    a, b = ranks.RankState(0, exit_step=40, exit_code=0), ranks.RankState(1, exit_step=40, exit_code=0)
    assert ranks.exit_step([a, b]) == 40 and ranks.exited_on_sigterm([a, b])
    b.exit_step = -1
    assert ranks.exit_step([a, b]) == -1 and not ranks.exited_on_sigterm([a, b])
    assert ranks.exit_codes([a, b]) == "exited with code 0"
    assert ranks.steps_per_s([(0.0, 10), (2.0, 30)]) == 10.0 and ranks.steps_per_s([(0.0, 10)]) == 0.0


@pytest.mark.parametrize("stop_at, steps, rate, expected", [
    (28, [25, 25], 2.0, 1.5),  # three steps to the named step at 2 steps/s
    (28, [25, 27], 2.0, 1.5),  # from the slowest rank
    (28, [-1, 26], 2.0, 1.0),  # a rank that has not said its step is not counted
    (28, [-1, -1], 2.0, 0.0),
    (28, [30, 31], 2.0, 0.0),  # past it already
    (28, [25, 25], 0.0, 0.0),  # no rate yet
    (200, [25, 25], 1.0, 5.0),  # at most most_s: the leader's Stop call waits the grace and 10 s
    (0, [25, 25], 2.0, 10.0),  # no step named: the backstop, 20 steps ahead
])
def test_the_steps_to_a_stop_step_come_on_top_of_the_grace(stop_at: int, steps: list[int], rate: float,
                                                            expected: float) -> None:
    assert ranks.steps_to_go_s(stop_at, steps, rate, 20, 5.0) == expected


def test_each_section_is_timed_on_the_ranks_clock_from_the_beat_that_began_it() -> None:
    """The beats' own times (``at``) time the sections: a burst read late by a busy elasticd
    (all received at 50.0) is not taken for slow steps."""
    seen, rs = learned.Learned(), ranks.RankState(0)
    for kind, step, at, note in [(BeatKind.START, 0, 100.0, ""), (BeatKind.STEP, 1, 110.0, ""),
                                 (BeatKind.STEP, 2, 110.1, ""), (BeatKind.SECTION, 2, 110.15, "checkpoint"),
                                 (BeatKind.SECTION, 2, 112.15, ""), (BeatKind.STEP, 3, 112.2, ""),
                                 (BeatKind.SECTION, 3, 112.3, "eval"), (BeatKind.STEP, 4, 117.3, "")]:
        ranks.note_beat(rs, beat(kind, step, at=at, note=note), now=50.0, seen=seen)
    got = seen.summary()
    assert got[learned.FIRST_STEP] == (1, pytest.approx(10.0)) and got["checkpoint"] == (1, pytest.approx(2.0))
    assert got["eval"] == (1, pytest.approx(5.0)) and got[learned.STEP] == (4, pytest.approx(0.1))
    assert rs.section == learned.STEP and rs.last_beat == 50.0
    ranks.note_beat(rs, beat(BeatKind.STEP, 5, at=117.0), now=51.0, seen=seen)  # (a clock stepped back)
    assert seen.summary()[learned.STEP][0] == 4
    ranks.note_beat(rs, beat(BeatKind.STEP, 10, at=118.0), now=52.0, seen=seen, checkpoint_every=10)
    assert rs.section == learned.CHECKPOINT  # (the save, or the wait for the rank that saves, comes next)
    ranks.note_beat(rs, beat(BeatKind.STEP, 11, at=120.5), now=53.0, seen=seen, checkpoint_every=10)
    assert rs.section == learned.STEP and seen.summary()[learned.CHECKPOINT] == (2, pytest.approx(2.5))


def test_the_monotonic_clock_times_sections_and_a_named_one_ends_in_the_one_it_interrupted() -> None:
    """A wall clock stepped forward by an hour (NTP) between two beats is not a step of an hour;
    an evaluation inside the first step (a compile) leaves the rest of it to the first step."""
    seen, rs = learned.Learned(), ranks.RankState(0)
    for kind, step, at, mono, note in [(BeatKind.START, 0, 100.0, 5.0, ""), (BeatKind.SECTION, 0, 101.0, 6.0, "eval"),
                                       (BeatKind.SECTION, 0, 3702.0, 7.0, ""), (BeatKind.STEP, 1, 3705.0, 10.0, "")]:
        if kind == BeatKind.SECTION and not note:
            assert rs.section == "eval"
        ranks.note_beat(rs, beat(kind, step, at=at, mono=mono, note=note), now=mono, seen=seen)
        if kind == BeatKind.SECTION and not note:
            assert rs.section == learned.FIRST_STEP  # (back in the first step)
    got = seen.summary()
    assert got["eval"] == (1, pytest.approx(1.0)) and got[learned.FIRST_STEP] == (2, pytest.approx(3.0)), got
