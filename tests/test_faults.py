"""Rank faults as data (an enum injected through the environment), on one node.

For each fault: the agent notices it (a hang after hang_timeout_s), tears the
generation down, the job resumes from the last committed checkpoint in
generation 2 and finishes with exactly the configured steps; no process is left.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from mselastic.core.states import GenerationState, JobState
from mselastic.trainer.faults import Fault, FaultPlan
from tests.harness import Etcd, Processes, elasticctl, generation_processes, lenet_spec, start_node, wait_for

pytestmark = pytest.mark.slow
JOB = "lenet"
TOTAL, FAULT_STEP, HANG_TIMEOUT_S = 50, 25, 6


RANK_FAULTS = [f for f in Fault if f is not Fault.CORRUPT_CHECKPOINT]


@pytest.mark.parametrize("fault", RANK_FAULTS, ids=[f.value for f in RANK_FAULTS])
def test_rank_fault_is_recovered_from_the_last_checkpoint(fault: Fault, procs: Processes, etcd: Etcd,
                                                          namespace: str, tmp_path: os.PathLike[str],
                                                          digits: str) -> None:
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"))
    ckpt = os.path.join(tmp, "ckpt")
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), ckpt, TOTAL,
                      hang_timeout_s=HANG_TIMEOUT_S,
                      env={"MSELASTIC_FAULT": f"{fault.value}:rank=1:generation=1:step={FAULT_STEP}"})
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    failed = wait_for("generation 1 to fail", lambda: (r := etcd.report(JOB, 1, "n0"))
                      and r.state is GenerationState.FAILED and r, 180, 0.1)
    assert failed.failed_rank == 1, failed.reason
    if fault is Fault.SIGSTOP:
        assert "no heartbeat" in failed.reason
        # The rank stopped right after its step-25 beat: detection follows the hang timeout.
        assert failed.step >= FAULT_STEP - 1
    assert not generation_processes(procs, 1), "generation 1 left processes behind"
    with open(os.path.join(ckpt, "latest.json")) as f:
        committed = json.load(open(os.path.join(ckpt, json.load(f)["manifest"])))["step"]
    second = wait_for("generation 2 first step", lambda: (r := etcd.report(JOB, 2, "n0")) and r.first_step_at
                      and r, 120, 0.2)
    assert second.resumed_step == committed
    # Rank 0 writes checkpoints, so even a SIGTERMed rank 1 (which exits on purpose after its
    # no-op save) resumes from the last interval checkpoint; see docs/DESIGN.md.
    assert committed == FAULT_STEP // 10 * 10
    status = wait_for("job to end", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 240, 0.5)
    assert status.state is JobState.SUCCEEDED, status.message
    assert status.generation == 2 and status.restart_count == 1
    rep = etcd.report(JOB, 2, "n0")
    assert rep is not None and rep.step == TOTAL
    # The job's timeline in etcd: the fault, when it was detected, the relaunch and the recovery.
    assert status.last_failure is not None and status.last_failure.rank == 1
    assert status.last_failure.detected_at == failed.detected_at and status.last_failure.recover_s > 0
    events = sorted((json.loads(v) for v in etcd.prefix(etcd.keys.events(JOB)).values()), key=lambda e: e["at"])
    kinds = [(e["kind"], e["generation"]) for e in events]
    assert kinds[:3] == [("submitted", 0), ("generation", 1), ("generation", 2)], kinds
    relaunch = events[2]
    assert relaunch["rank"] == 1 and relaunch["node_id"] == "n0" and failed.reason in relaunch["message"]
    assert ("recovered", 2) in kinds and kinds[-1] == ("succeeded", 2)


def test_hang_detection_time_and_escalation(procs: Processes, etcd: Etcd, namespace: str,
                                            tmp_path: os.PathLike[str], digits: str) -> None:
    """A SIGSTOPped rank is noticed after hang_timeout_s, then SIGCONT -> SIGTERM -> SIGKILL."""
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"))
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                      TOTAL, hang_timeout_s=HANG_TIMEOUT_S, max_restarts=0,
                      env={"MSELASTIC_FAULT": f"sigstop:rank=1:generation=1:step={FAULT_STEP}"})
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    wait_for("step before the hang", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= FAULT_STEP - 1,
             180, 0.05)
    hung_from = time.time()
    failed = wait_for("the hang to be detected", lambda: (r := etcd.report(JOB, 1, "n0"))
                      and r.state is GenerationState.FAILED and r, HANG_TIMEOUT_S + 10, 0.05)
    assert HANG_TIMEOUT_S - 1.5 <= failed.detected_at - hung_from <= HANG_TIMEOUT_S + 2
    # The escalation ends within its short grace (3 s) plus the kill.
    assert failed.stopped_at - failed.detected_at <= 3 + 2
    assert not generation_processes(procs, 1)
    # max_restarts = 0: the job fails cleanly and says why.
    status = wait_for("job to fail", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 20, 0.2)
    assert status.state is JobState.FAILED and "restarts exhausted" in status.message


def test_corrupt_newest_checkpoint_falls_back_and_the_event_says_so(procs: Processes, etcd: Etcd, namespace: str,
                                                                    tmp_path: os.PathLike[str], digits: str) -> None:
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"))
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                      TOTAL, env={"MSELASTIC_FAULT": f"corrupt_checkpoint:rank=0:generation=1:step={FAULT_STEP}"})
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    status = wait_for("job to end", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 300, 0.5)
    assert status.state is JobState.SUCCEEDED, status.message
    second = etcd.report(JOB, 2, "n0")
    assert second is not None and second.step == TOTAL
    # Step 20's checkpoint was damaged: generation 2 resumed from step 10 and said why.
    assert second.resumed_step == 10
    assert "skipped unusable ckpt-00000020.json" in second.resume_note and "checksum" in second.resume_note
    events = [json.loads(v) for v in etcd.prefix(etcd.keys.events(JOB)).values()]
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert len(recovered) == 1 and "resumed from step 10" in recovered[0]["message"]
    assert "ckpt-00000020.json" in recovered[0]["message"]


def test_fault_spec_parsing() -> None:
    plan = FaultPlan.parse("abort:rank=2:generation=3:step=40")
    assert plan == FaultPlan(Fault.ABORT, 2, 3, 40, 3)
    assert FaultPlan.parse("exit:rank=1:generation=1-2:step=5").last_generation == 2
    for bad in ("nap:rank=1:generation=1:step=1", "sigkill:rank=1", "sigkill:rank=x:generation=1:step=1"):
        with pytest.raises(ValueError, match="MSELASTIC_FAULT"):
            FaultPlan.parse(bad)
