"""The agent's verdict on a generation (mselastic.agent.generation.verdict.judge) as a table: one row per
fault of the failure matrix that an agent sees on its own node, and the looks that are no fault.
No process is started: each row is one look, written out."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("what, seen, expected", ROWS, ids=[r[0] for r in ROWS])
def test_judge(what: str, seen: Look, expected: tuple[int, C, str] | None) -> None:
    fault = judge(seen, T)
    if expected is None:
        assert fault is None, fault
    else:
        assert isinstance(fault, Fault) and (fault.rank, fault.cause) == expected[:2], fault
        assert expected[2] in fault.reason, fault.reason
