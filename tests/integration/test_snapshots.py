"""Snapshots between checkpoints: a crashed rank costs at most a step, not a checkpoint interval.

One node, real etcd, elasticd, msrun and MindSpore workers; ranks SIGKILLed from outside.
"""

from __future__ import annotations

import glob
import json
import os
import signal

import pytest

from mselastic.core.states import GenerationState, JobState
from tests.harness import DATA_DIR, Etcd, Pace, Processes, check_history, elasticctl, lenet_spec, start_node, \
    still_running, wait_for, worker_pids

pytestmark = pytest.mark.slow
JOB = "lenet"
TOTAL = 30


def kill_and_resume(procs: Processes, etcd: Etcd, generation: int, rank: int, past: int) -> tuple[int, int]:
    """SIGKILL ``rank`` of ``generation`` once it is past step ``past``; (the step the generation
    reached, the step the next one resumed from)."""
    wait_for(f"generation {generation} past step {past}",
             lambda: (r := etcd.report(JOB, generation, "n0")) and r.step > past, 180, 0.05)
    victim = worker_pids(procs, generation)[rank]
    still_running(etcd, JOB, f"the kill of rank {rank}")
    os.kill(victim, signal.SIGKILL)
    failed = wait_for(f"generation {generation} FAILED", lambda: (r := etcd.report(JOB, generation, "n0"))
                      and r.state is GenerationState.FAILED and r, 10, 0.05)
    assert failed.failed_rank == rank
    nxt = wait_for(f"generation {generation + 1}'s first step", lambda: (r := etcd.report(JOB, generation + 1, "n0"))
                   and r.first_step_at and r, 180, 0.1)
    return failed.step, nxt.resumed_step


def test_a_killed_rank_costs_at_most_a_step_even_when_it_held_the_snapshots(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    tmp = str(tmp_path)
    work, out, ckpt = os.path.join(tmp, "work"), os.path.join(tmp, "out"), os.path.join(tmp, "ckpt")
    endpoint = start_node(procs, etcd, namespace, work)
    # No interval checkpoint before the end: without snapshots every relaunch would start at step 0.
    pace = Pace(tmp, 0.3)  # until both kills are done, on any machine
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, out, ckpt, TOTAL, checkpoint_interval_steps=100,
                      snapshot_interval_steps=1, args=["--data", DATA_DIR, "--out", out, "--lr", "0.05", *pace.args])
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0

    # Rank 1 (not the one keeping the node's snapshots), then rank 0 (the keeper and the writer).
    reached, resumed = kill_and_resume(procs, etcd, 1, rank=1, past=6)
    assert reached - 1 <= resumed <= reached, (reached, resumed)
    reached, resumed = kill_and_resume(procs, etcd, 2, rank=0, past=resumed + 5)
    assert reached - 1 <= resumed <= reached, (reached, resumed)
    pace.release()
    # The snapshots it resumed from are checkpoints now, the kind plain MindSpore loads.
    assert os.path.exists(os.path.join(ckpt, f"ckpt-{resumed:08d}-g000002.ckpt"))

    status = wait_for("job to finish", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 240, 0.5)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, TOTAL, interval=100, snapshots=True)
    with open(os.path.join(out, "result_g3.json")) as f:
        result = json.load(f)
    assert result["final_step"] == TOTAL and result["resumed_from"] == resumed
    # The job is done: its snapshots no longer take memory on the node (removed by the agent once
    # its generation ended, which the leader's status need not wait for).
    roots = glob.glob(os.path.join(work, "snapshots", "n0-*"))
    assert len(roots) == 1
    wait_for("the job's snapshot folder gone", lambda: not os.path.exists(os.path.join(roots[0], JOB)), 10, 0.1)
