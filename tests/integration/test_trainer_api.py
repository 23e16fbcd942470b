"""The high-level trainer API (``mselastic.trainer.elastic``): the classic data-parallel script made
elastic with three added lines, and ``Model.train`` with a callback, under elasticd with a rank
SIGKILLed from outside and the world size changed, against an uninterrupted run."""

from __future__ import annotations

import ast
import difflib
import json
import os
import signal
from typing import Any

import numpy as np
import pytest

from mselastic.core.states import JobState
from mselastic.store.embedded import free_port
from tests.cluster import Cluster
from tests.harness import DATA_DIR, REPO, VENV_BIN, Processes, check_history, elasticctl, lenet_spec, msrun_done, \
    params, rank_steps, still_running, wait_for, worker_pids
from tests.integration.test_elastic import WORLD_CHANGE_ATOL, check_exactly_once, committed_samples

CLASSIC = os.path.join(REPO, "examples", "classic")
MODEL = os.path.join(REPO, "examples", "model", "train.py")
JOB = "lenet"


def code_lines(path: str) -> list[str]:
    """The script's lines without its module docstring (what a user reads as the change)."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) and \
        isinstance(tree.body[0].value, ast.Constant) else None
    lines = source.splitlines()
    if doc is not None:
        lines = lines[:doc.lineno - 1] + lines[doc.end_lineno:]  # type: ignore[operator]
    return lines


def test_the_classic_script_becomes_elastic_with_three_added_lines_and_none_changed() -> None:
    plain, elastic = code_lines(os.path.join(CLASSIC, "plain.py")), code_lines(os.path.join(CLASSIC, "train.py"))
    diff = [d for d in difflib.ndiff(plain, elastic) if d[:2] in ("+ ", "- ")]
    added, removed = [d for d in diff if d.startswith("+ ")], [d for d in diff if d.startswith("- ")]
    assert not removed, f"lines of the plain script changed: {removed}"
    assert 1 <= len(added) <= 3, f"{len(added)} lines added: {added}"
    assert all(line.rstrip().endswith("# elastic") for line in added), added
    # The user guide opens its trainer section with this diff: the same added lines.
    with open(os.path.join(REPO, "docs", "user-guide.md")) as f:
        readme = f.read()
    block = readme.split("<!-- classic-diff -->", 1)[1].split("```diff\n", 1)[1].split("```", 1)[0]
    assert [line[1:] for line in block.splitlines() if line.startswith("+")] == [a[2:] for a in added]


TOTAL = 40


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The baseline: ``examples/classic/loop.py`` (the classic script's loop written over
    ``elastic.batches()``) in elastic mode under plain msrun, world size 2, no fault, the job's
    variables set by hand, to TOTAL steps; it must have checkpointed at TOTAL. Shared by the tests
    below: the classic loop and ``Model.train`` train the same LeNet on the same stream and land
    within float32 noise of it (2.4e-7 after a world-size change, measured)."""
    out = str(tmp_path_factory.mktemp("baseline"))
    run_elastic_msrun(os.path.join(CLASSIC, "loop.py"), out, world=2)
    manifests = sorted(n for n in os.listdir(os.path.join(out, "ckpt")) if n.endswith(".json") and n != "latest.json")
    assert manifests[-1].startswith(f"ckpt-{TOTAL:08d}"), manifests
    return params(out)


def run_elastic_msrun(script: str, out: str, world: int) -> None:
    """``script`` in elastic mode under plain msrun (the job's variables set by hand), to TOTAL steps."""
    procs = Processes("msrun-" + os.path.basename(out), out)
    try:
        p = procs.start("msrun", [
            os.path.join(VENV_BIN, "msrun"), f"--worker_num={world}", f"--local_worker_num={world}",
            f"--master_port={free_port()}", f"--log_dir={os.path.join(out, 'logs')}", "--join=True",
            "--tail_worker_log=99999", script, DATA_DIR, out],
            env={"MSELASTIC_CHECKPOINT_DIR": os.path.join(out, "ckpt"), "MSELASTIC_TOTAL_STEPS": str(TOTAL),
                 "MSELASTIC_GLOBAL_BATCH_SIZE": "32"})
        msrun_done(p, world, f"{script} failed; see {out}/logs")
    finally:
        assert not procs.stop_all()


VARIANTS = {
    "classic-graph": (os.path.join(CLASSIC, "train.py"), []),
    "model-train": (MODEL, []),
    "model-train-sink-pynative": (MODEL, ["--sink", "--mode", "pynative"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_rank_sigkilled_and_a_world_size_change_cost_no_sample_and_no_accuracy(
        variant: str, cluster: Cluster, uninterrupted: dict[str, Any]) -> None:
    """Under elasticd on two nodes (one rank each): rank 1 SIGKILLed from outside mid-run; its node is
    quarantined (after one failure), so the job goes on at world size 1 from the last checkpoint. It
    ends at total_steps with every sample of an epoch consumed once in the committed trajectory and
    parameters within the tolerance of an uninterrupted run at world size 2 (in GRAPH_MODE). The
    classic script in GRAPH_MODE; Model.train in GRAPH_MODE, and in PYNATIVE with data sink mode
    asked for (on CPU MindSpore trains non-sink anyway: the sink accounting is tested below)."""
    script, extra = VARIANTS[variant]
    cluster.up(2)
    cluster.start_nodes(0, 1)
    out, samples = os.path.join(cluster.tmp, "out"), os.path.join(cluster.tmp, "samples")
    spec = lenet_spec(os.path.join(cluster.tmp, "job.toml"), JOB, out, os.path.join(cluster.tmp, "ckpt"), TOTAL,
                      workers=1, min_nodes=1, max_nodes=2, script=script, args=[DATA_DIR, out, *extra],
                      quarantine_after_failures=1, quarantine_cooldown_s=600, snapshot_interval_steps=1,
                      env={"MSELASTIC_RECORD_SAMPLES": samples})
    assert elasticctl("submit", spec, endpoint=cluster.endpoint(0)).returncode == 0
    etcd = cluster.etcd
    assert etcd is not None
    # Right after the checkpoint at 20, by rank 1's own heartbeats: rank 0 (its node's snapshot
    # keeper) is writing that checkpoint in the background, and its snapshots must not wait for it.
    # (The victim is found first: a scan of /proc between the step and the kill is time in which a
    # fast machine finishes these scripts' last 19 steps.)
    victim = wait_for("rank 1's pid", lambda: worker_pids(cluster.procs, 1).get(1), 240, 0.2)
    wait_for("generation 1 past its checkpoint at 20",
             lambda: rank_steps(cluster.endpoint(1), 1).get(1, 0) >= 21, 240, 0.05)
    still_running(etcd, JOB, "the kill")
    os.kill(victim, signal.SIGKILL)
    status = wait_for("job to finish", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 300, 0.5)
    assert status.state is JobState.SUCCEEDED, status.message
    plans = check_history(etcd, JOB, TOTAL, snapshots=True)
    assert [p.world_size for p in plans] == [2, 1] and [m.node_id for m in plans[1].members] == ["n0"]
    # Resumed from n0's snapshot (not the checkpoint at 20, once past 21): at most the step being trained is lost.
    reached = max(r.step for n in ("n0", "n1") if (r := etcd.report(JOB, 1, n)))
    resumed = etcd.report(JOB, 2, "n0")
    assert resumed is not None and reached - 1 <= resumed.resumed_step <= reached, (reached, resumed.resumed_step)
    assert status.last_failure is not None and status.last_failure.rank == 1
    committed = {s: v for s, v in committed_samples(samples).items() if s <= TOTAL}
    check_exactly_once(committed, TOTAL)
    assert {w for _, w, _ in committed.values()} == {1, 2}
    with open(os.path.join(out, "done_rank0.json")) as f:
        assert json.load(f)["world_size"] == 1
    final = params(out)
    assert sorted(final) == sorted(uninterrupted)
    worst = max(float(np.abs(final[k] - uninterrupted[k]).max()) for k in final)
    assert worst < WORLD_CHANGE_ATOL, f"parameters {worst:.2e} from the uninterrupted run"


def model_train_session(monkeypatch: pytest.MonkeyPatch, checkpoint_interval_steps: int) -> tuple[Any, list[int]]:
    """This process's elastic session as rank 0 of 2 in generation 2 (total_steps 25), agreed on
    a fresh start, with no MindSpore cluster: the callbacks' accounting alone. Returns it and the
    steps the agent is told the job finished at."""
    from mselastic.core.batching import batch_layout
    from mselastic.trainer import elastic
    from mselastic.trainer.context import ElasticContext

    layout = batch_layout(32, 2, ())
    assert layout is not None
    ctx = ElasticContext(rank=0, world_size=2, job="j", generation=2, restart_count=0, checkpoint_dir="",
                         checkpoint_interval_steps=checkpoint_interval_steps, keep_checkpoints=3, total_steps=25,
                         global_batch_size=32, layout=layout, stop_check_interval_steps=1000)
    session = elastic.Session()
    session.ctx, session.agreed = ctx, True
    monkeypatch.setattr(elastic, "_SESSION", session)
    finished: list[int] = []
    monkeypatch.setattr(ctx, "finished", lambda step, loss: finished.append(step))
    return session, finished


def test_model_train_in_sink_mode_checkpoints_and_stops_at_sink_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Data sink mode calls back once per sink (every 10 steps here): a checkpoint at each boundary
    past a multiple of the interval, total_steps (25) reached at the first boundary past it (30),
    where the job is told it finished and Model.train to stop. (On CPU MindSpore never sinks: this
    is the accounting alone, with the callback MindSpore would call.)"""
    from mselastic.trainer import elastic

    session, finished = model_train_session(monkeypatch, checkpoint_interval_steps=10)
    saves: list[int] = []
    monkeypatch.setattr(session, "save", saves.append)

    class Params:
        cur_step_num = 0
        net_outputs = 1.5

    class RunContext:
        stopped_at: list[int] = []

        def original_args(self) -> Params:
            return params

        def request_stop(self) -> None:
            self.stopped_at.append(params.cur_step_num)

    params, run = Params(), RunContext()
    callback = elastic.Callback()
    for n in (10, 20, 30):
        params.cur_step_num = n
        callback.on_train_step_end(run)
    assert saves == [10, 20, 30] and run.stopped_at == [30] and finished == [30]
    assert session.step == 30 and session.loss == 1.5
    callback.on_train_end(run)
    assert finished == [30]  # told once


def test_model_train_that_runs_out_of_epochs_before_total_steps_ends_the_job_there(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Model.train returned normally at step 20 of 25 (its epochs ran out): the job ends there,
    said out loud, after a last checkpoint."""
    from mselastic.trainer import elastic

    session, finished = model_train_session(monkeypatch, checkpoint_interval_steps=20)
    saves: list[int] = []
    monkeypatch.setattr(session, "save", lambda step: (saves.append(step), setattr(session, "saved_step", step)))

    class Params:
        cur_step_num = 0
        net_outputs = (2.0,)

    class RunContext:
        def original_args(self) -> Params:
            return params

        def request_stop(self) -> None:
            raise AssertionError("not at total_steps")

    params, run, callback = Params(), RunContext(), elastic.Callback()
    for n in (10, 15):
        params.cur_step_num = n
        callback.on_train_step_end(run)
    assert finished == [] and saves == []
    callback.on_train_end(run)
    assert saves == [15] and finished == [15] and "before the job's total_steps 25" in caplog.text
