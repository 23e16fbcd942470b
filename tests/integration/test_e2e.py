"""One node end to end: real etcd, elasticd, msrun and MindSpore workers, real signals."""

from __future__ import annotations

import json
import os
import pwd
import signal
import time
from typing import Callable

import numpy as np
import psutil
import pytest

from mselastic.core.kinds import RelaunchReason
from mselastic.core.states import FailureCause, GenerationState, JobState
from mselastic.store.embedded import free_port
from tests.harness import DATA_DIR, Etcd, Pace, Processes, elasticctl, elasticd_cmd, generation_processes, \
    holds_for, lenet_spec, local_socket, longest_step_gap, standby_processes, start_node, still_running, \
    wait_for, worker_pids

pytestmark = pytest.mark.slow
JOB = "lenet"  # the harness helpers assume this job name


def test_lenet_completes_as_an_unprivileged_user_with_identical_parameters(
        procs: Processes, etcd: Etcd, namespace: str, shared_tmp: str, digits: str, python_for_nobody: None) -> None:
    """elasticd (root) runs the job as a uid of its own (job_uids: the first of the range, the
    namespace being new): msrun and every worker have that uid, inherit none of elasticd's own
    environment beyond the allowlist, and write files others cannot read; a job env that sets a
    loader variable is refused; describe hides env values."""
    tmp = shared_tmp
    port = free_port()
    cmd = elasticd_cmd("n0", etcd.endpoint, port, os.path.join(tmp, "work"), namespace) + ["--job-uids", "62300-62309"]
    procs.start("elasticd-n0", cmd, env={"ELASTICD_TEST_SECRET": "s3cret"})
    wait_for("n0 registered and leading", lambda: etcd.get(etcd.keys.node("n0")) and etcd.leader() == "n0", 30)
    endpoint = "unix:" + local_socket(os.path.join(tmp, "work"))
    # The job's folders are the worker user's: out made for it, checkpoint_dir made by it (under a
    # folder of its own: root never creates or hands over a path a spec names).
    job_uid = 62300  # (the job's uid: the first of job_uids)
    out, jobs = os.path.join(tmp, "out"), os.path.join(tmp, "jobs")
    for d in (out, jobs):
        os.makedirs(d)
        os.chown(d, job_uid, -1)
    ckpt = os.path.join(jobs, "lenet", "ckpt")
    bad = lenet_spec(os.path.join(tmp, "bad.toml"), JOB, out, ckpt, total_steps=40, env={"LD_PRELOAD": "/tmp/x.so"})
    r = elasticctl("submit", bad, endpoint=endpoint)
    assert r.returncode == 2 and "LD_PRELOAD may not be set by a job" in r.stderr and len(r.stderr.splitlines()) == 1
    pace = Pace(tmp, 0.3)  # until its processes are looked at (the job's uid can see the release in tmp)
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, out, ckpt, total_steps=20, env={"API_TOKEN": "t0ken"},
                      args=["--data", DATA_DIR, "--out", out, "--lr", "0.05", *pace.args])
    r = elasticctl("submit", spec, endpoint=endpoint)
    assert r.returncode == 0, r.stderr
    wait_for("step 5", lambda: (rep := etcd.report(JOB, 1, "n0")) and rep.step >= 5, 180, 0.2)
    processes = generation_processes(procs, 1)
    still_running(etcd, JOB, "its processes were looked at")
    assert len(worker_pids(procs, 1)) == 2 and len(processes) >= 3  # msrun, its scheduler, the workers
    for p in processes:
        assert p.uids().real == job_uid and p.uids().effective == job_uid, (p.pid, p.cmdline()[:3], p.uids())
        env = p.environ()
        assert "ELASTICD_TEST_SECRET" not in env and env["API_TOKEN"] == "t0ken" and env["USER"] == "62300"
    described = elasticctl("describe", "job", JOB, "-o", "json", endpoint=endpoint).stdout
    assert "t0ken" not in described and "API_TOKEN" in described
    pace.release()
    status = wait_for("job to succeed",
                      lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 240, poll_s=0.5)
    assert status.state is JobState.SUCCEEDED, status.message
    assert status.generation == 1 and status.restart_count == 0
    with open(os.path.join(out, "result_g1.json")) as f:
        result = json.load(f)
    assert result["final_step"] == 20 and result["world_size"] == 2
    p0, p1 = np.load(os.path.join(out, "params_rank0.npz")), np.load(os.path.join(out, "params_rank1.npz"))
    assert sorted(p0.files) == sorted(p1.files) and len(p0.files) == 8  # LeNet: 2 conv (no bias), 3 dense
    for name in p0.files:
        assert np.array_equal(p0[name], p1[name]), f"{name} differs between ranks"
    report = etcd.report(JOB, 1, "n0")
    assert report is not None and report.state is GenerationState.SUCCEEDED and report.step == 20
    # What the job wrote belongs to its uid and is not for others (elasticd's umask 027, inherited).
    written = [os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.startswith("ckpt-")]
    logs = os.path.join(tmp, "work", "logs", JOB, "g000001")
    written += [os.path.join(logs, n) for n in os.listdir(logs)]
    assert os.stat(ckpt).st_uid == job_uid
    assert written and all(os.stat(f).st_uid == job_uid for f in written if not f.endswith("msrun.log"))
    assert all(os.stat(f).st_mode & 0o007 == 0 for f in written), {f: oct(os.stat(f).st_mode) for f in written}
    wait_for("generation 1 processes gone", lambda: not generation_processes(procs, 1), 15)


def test_rank_kill_is_detected_torn_down_and_resumed(procs: Processes, etcd: Etcd, namespace: str,
                                                     tmp_path: os.PathLike[str], digits: str) -> None:
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"))
    out, ckpt = os.path.join(tmp, "out"), os.path.join(tmp, "ckpt")
    total = 35
    pace = Pace(tmp, 0.3)  # until the kill's relaunch is committed
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, out, ckpt, total_steps=total,
                      args=["--data", DATA_DIR, "--out", out, "--lr", "0.05", *pace.args])
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    plan1 = wait_for("generation 1", lambda: etcd.plan(JOB), 30)
    # Kill once a checkpoint exists and training is past it.
    wait_for("step 17 of generation 1", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 17, 180, poll_s=0.2)
    old = generation_processes(procs, 1)
    roles = {p.environ().get("MS_ROLE", "msrun") for p in old}
    assert {"MS_WORKER", "MS_SCHED"} <= roles, roles
    victim = worker_pids(procs, 1)[1]
    still_running(etcd, JOB, "the kill")

    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    failed = wait_for("generation 1 reported FAILED",
                      lambda: (r := etcd.report(JOB, 1, "n0")) and r.state is GenerationState.FAILED and r, 5,
                      poll_s=0.02)
    observed_s = time.time() - killed_at
    assert failed.detected_at - killed_at < 1.0, f"detected {failed.detected_at - killed_at:.3f}s after the kill"
    assert observed_s < 1.0, f"report visible in etcd {observed_s:.3f}s after the kill"
    assert failed.failed_rank == 1
    # Nothing of generation 1 survives: msrun, its scheduler, the workers (and tails, if any).
    assert not [p for p in old if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not generation_processes(procs, 1)
    with open(os.path.join(ckpt, "latest.json")) as f:
        checkpointed = json.load(open(os.path.join(ckpt, json.load(f)["manifest"])))["step"]
    assert checkpointed >= 10

    plan2 = wait_for("generation 2 committed", lambda: (p := etcd.plan(JOB)) and p.generation == 2 and p, 10)
    pace.release()
    assert plan2.master_port != plan1.master_port and plan2.restart_count == 1
    started = wait_for("generation 2 first step",
                       lambda: (r := etcd.report(JOB, 2, "n0")) and r.first_step_at and r, 120, poll_s=0.2)
    assert started.resumed_step == checkpointed

    status = wait_for("job to finish", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 240, poll_s=0.5)
    assert status.state is JobState.SUCCEEDED, status.message
    assert status.generation == 2 and status.restart_count == 1
    assert status.last_failure is not None and status.last_failure.rank == 1 and status.last_failure.recover_s > 0
    with open(os.path.join(out, "result_g2.json")) as f:
        result = json.load(f)
    assert result["final_step"] == total and result["resumed_from"] == checkpointed

    # elasticctl shows the same story.
    r = elasticctl("status", JOB, "-o", "json", endpoint=endpoint)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)["jobs"][0]
    assert shown["state"] == "JOB_STATE_SUCCEEDED" and shown["generation"] == 2
    assert shown["last_failure"]["rank"] == 1 and shown["last_failure"]["recover_s"] > 0
    table = elasticctl("status", endpoint=endpoint).stdout
    assert "SUCCEEDED" in table and "rank 1 on n0" in table and "recovered in" in table


#: How test_elasticd_restarted_under_a_job_adopts_its_generation stops elasticd, in turn: as a
#: crash does, then as systemctl restart does three times (six made the suite 30 s longer and
#: found nothing three do not; test_cluster's and test_systemd's restarts come on top).
RESTARTS = (signal.SIGKILL, *(signal.SIGTERM,) * 3)


def test_elasticd_restarted_under_a_job_adopts_its_generation(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    """#45: elasticd is not the parent of the workload any more. SIGKILLed (a crash) or SIGTERMed
    (a restart, an upgrade: it leaves the generation to its shim and exits 0 without revoking its
    lease), it leaves the generation training under its shim (msrun's parent); started again (as
    systemd would, or by hand), it takes over the registration's lease and adopts the
    generation: the same worker pids, generation 1 all along, no restart counted, the progress
    reported again, no gap between two steps of rank 0 longer than 2 x the step time + 1 s (its
    own per-step record, sampled every 0.1 s), and the job ends as it would have. Four times in
    a row (``RESTARTS``)."""
    tmp = str(tmp_path)
    cmd, _, pace, out = _paced_job_on_a_restartable_node(procs, etcd, namespace, tmp, DATA_DIR)
    wait_for("training", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 3, 120, poll_s=0.2)
    gap = _restart_under(procs, etcd, cmd, 1, RESTARTS, os.path.join(out, "samples_g1_r0.jsonl"), keeps_lease=True)
    pace.release()
    print(f"adoption: rank 0's longest gap between two steps through {len(RESTARTS)} restarts of elasticd "
          f"({', '.join(s.name for s in RESTARTS)}): {gap:.2f}s (steps paced at 0.3 s)")
    assert gap <= 2 * 0.3 + 1.0, gap
    status = wait_for("the job to end", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 120, 0.5)
    assert status.state is JobState.SUCCEEDED and status.generation == 1 and status.restart_count == 0, status
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:
        log = f.read()
    assert log.count("generation adopted: msrun pid") == len(RESTARTS), log[-3000:]
    assert etcd.report(JOB, 1, "n0").adoptions == len(RESTARTS)  # type: ignore[union-attr]
    assert log.count("generation left to its shim") == RESTARTS.count(signal.SIGTERM)
    wait_for("nothing of the generation left", lambda: not generation_processes(procs, 1), 15)


WARM_RESTARTS = (signal.SIGTERM, signal.SIGKILL, signal.SIGTERM)


def _paced_job_on_a_restartable_node(procs: Processes, etcd: Etcd, namespace: str, tmp: str, data: str,
                                     warm: bool = False) -> tuple[list[str], str, Pace, str]:
    """Node n0 (with standbys when ``warm``) and a LeNet job paced at 0.3 s a step, recording the
    samples each rank consumes: (the command that starts n0 again, its endpoint, the pace, the
    job's output folder)."""
    work = os.path.join(tmp, "work")
    cmd = elasticd_cmd("n0", etcd.endpoint, free_port(), work, namespace, warm_standbys=warm)
    procs.start("elasticd-n0", cmd)
    wait_for("n0 registered and leading", lambda: etcd.get(etcd.keys.node("n0")) and etcd.leader() == "n0", 30)
    endpoint = "unix:" + local_socket(work)
    pace = Pace(tmp, 0.3)
    out = os.path.join(tmp, "out")
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, out, os.path.join(tmp, "ckpt"), total_steps=150,
                      args=["--data", data, "--out", out, "--lr", "0.05", "--record-samples", *pace.args])
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    return cmd, endpoint, pace, out


def _restart_under(procs: Processes, etcd: Etcd, cmd: list[str], generation: int, signals: tuple[signal.Signals, ...],
                   samples: str, keeps_lease: bool = False, also: Callable[[], bool] = lambda: True) -> float:
    """elasticd of n0 signalled with each of ``signals`` in turn and started again with ``cmd``,
    under ``generation``: each time it exits as the signal says (0 after SIGTERM), the generation
    trains on without it (the same worker pids, ``also()``, its report RUNNING), the successor
    reports progress, and the plan stays ``generation``; with ``keeps_lease``, the lease is not
    revoked by the one leaving. Returns rank 0's longest gap between two steps meanwhile (its
    ``samples`` file, the times the rank recorded)."""
    pids = worker_pids(procs, generation)
    lease = etcd.lease_of(etcd.keys.node("n0"))
    since = time.time()
    for i, sig in enumerate(signals):
        still_running(etcd, JOB, f"{sig.name} {i + 1}")
        daemon = procs.started[-1]
        os.kill(daemon.pid, sig)
        assert daemon.wait(timeout=30) == (0 if sig == signal.SIGTERM else -sig), (sig, daemon.returncode)
        if keeps_lease:
            assert etcd.lease_of(etcd.keys.node("n0")) == lease  # (not revoked: its TTL has not run out yet)
        holds_for("the generation training without elasticd",
                  lambda: worker_pids(procs, generation) == pids and also(), 1.0)
        left = etcd.report(JOB, generation, "n0")
        assert left is not None and left.state is GenerationState.RUNNING, left
        procs.start("elasticd-n0", cmd)
        wait_for("progress reported by the successor",
                 lambda: (r := etcd.report(JOB, generation, "n0")) and r.step > left.step + 3, 60, 0.2)
        assert worker_pids(procs, generation) == pids and also()
        # Kept by id; or, when the successor's start took longer than the TTL (a loaded machine
        # starts Python slowly), registered anew: the generation is adopted all the same.
        lease = etcd.lease_of(etcd.keys.node("n0"))
        assert (p := etcd.plan(JOB)) is not None and p.generation == generation
    return longest_step_gap(samples, since, time.time())


def test_a_warm_generation_outlives_restarts_of_elasticd_and_a_rank_lost_after_is_a_failure(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    """#45, warm generations: a rank SIGKILLed, the relaunch handed to standbys (generation 2, warm:
    its ranks the children of the job's fork server, not msrun's). Then elasticd restarted three
    times under it (SIGTERM, SIGKILL, SIGTERM, each followed by the same command): the fork server
    and the guard outlive elasticd, the successor adopts the ranks (the same pids, generation 2
    all along, no gap between two steps longer than 2 x the step time + 1 s). A rank SIGKILLed
    after the last adoption is a failure like any other (the successor reads its end from the
    kernel and its code from the fork server's record: killed by SIGKILL) and relaunched, the two
    restarts counted; once the job is stopped, no standby, fork server or rank is left."""
    tmp = str(tmp_path)
    cmd, endpoint, pace, out = _paced_job_on_a_restartable_node(procs, etcd, namespace, tmp, digits, warm=True)
    wait_for("generation 1 training, and three standbys and their fork server",
             lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 3 and len(standby_processes(procs)) == 4, 180, 0.2)
    os.kill(worker_pids(procs, 1)[1], signal.SIGKILL)
    second = wait_for("generation 2 training", lambda: (r := etcd.report(JOB, 2, "n0")) and r.step >= 3 and r, 90, 0.2)
    assert second.warm, second
    pids = worker_pids(procs, 2)
    server = {psutil.Process(pid).ppid() for pid in pids.values()}
    assert len(pids) == 2 and len(server) == 1, (pids, server)

    # The successors keep no standbys of their own (a fork server each would import MindSpore on
    # the cores the job trains on): they adopt the warm generation all the same.
    without = [("false" if a == "true" and cmd[i - 1] == "--warm-standbys" else a) for i, a in enumerate(cmd)]
    gap = _restart_under(procs, etcd, without, 2, WARM_RESTARTS, os.path.join(out, "samples_g2_r0.jsonl"),
                         also=lambda: {psutil.Process(pid).ppid() for pid in pids.values()} == server)  # (the first's)
    print(f"warm adoption: rank 0's longest gap between two steps through {len(WARM_RESTARTS)} restarts of "
          f"elasticd ({', '.join(s.name for s in WARM_RESTARTS)}): {gap:.2f}s (steps paced at 0.3 s)")
    assert gap <= 2 * 0.3 + 1.0, gap
    assert etcd.report(JOB, 2, "n0").adoptions == len(WARM_RESTARTS)  # type: ignore[union-attr]
    shown = elasticctl("nodes", endpoint=endpoint)  # (what an operator sees)
    assert shown.returncode == 0 and "lenet (adopted)" in shown.stdout, shown
    os.kill(pids[0], signal.SIGKILL)
    failed = wait_for("generation 2 to fail", lambda: (r := etcd.report(JOB, 2, "n0")) and r.state.terminal and r,
                      60, 0.1)
    assert failed.state is GenerationState.FAILED and failed.failed_rank == 0, failed
    assert failed.cause is FailureCause.RANK_EXITED and "killed by SIGKILL" in failed.reason, failed
    third = wait_for("generation 3 committed", lambda: (p := etcd.plan(JOB)) and p.generation == 3 and p, 60, 0.2)
    assert third.restart_count == 2, third  # (the relaunch after the adoption counted like any other)
    pace.release()  # (the job is not trained to its end: the relaunch is all this test is about)
    assert elasticctl("stop", JOB, "--grace-period-s", "1", endpoint=endpoint).returncode == 0
    assert (status := etcd.status(JOB)) is not None and status.state is JobState.STOPPED, status
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:
        log = f.read()
    assert log.count("generation adopted: warm ranks") == len(WARM_RESTARTS), log[-3000:]
    assert log.count("generation left to its shim") == WARM_RESTARTS.count(signal.SIGTERM)
    wait_for("no standby or fork server left", lambda: not standby_processes(procs), 30)
    wait_for("nothing of generations 2 and 3 left",
             lambda: not generation_processes(procs, 2) and not generation_processes(procs, 3), 15)


def test_a_stop_lost_on_the_wire_is_sent_again_by_the_leaders_reconcile_pass_alone(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    """#48: `elasticctl stop` records the intent (STOPPED, with its grace) and the leader's reconcile
    pass stops the members. The member's elasticd (n1; the leader, n0, has no slots) is frozen
    (SIGSTOP) across the stop, longer than the Stop call's deadline (its lease TTL, 20 s, keeps it
    registered): the first Stop is lost. Once it runs again, the pass sends the Stop again by
    itself (its log says so), and the generation is stopped there: STOPPED in its report, its
    processes gone, the job STOPPED."""
    tmp = str(tmp_path)
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, free_port(), os.path.join(tmp, "w0"), namespace,
                                            slots=0, insecure=True))
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    n1 = procs.start("elasticd-n1", elasticd_cmd("n1", etcd.endpoint, free_port(), os.path.join(tmp, "w1"), namespace,
                                                 lease_ttl_s=20, insecure=True))
    wait_for("n1 registered", lambda: etcd.get(etcd.keys.node("n1")), 30)
    endpoint = "unix:" + local_socket(os.path.join(tmp, "w0"))
    out = os.path.join(tmp, "out")
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, out, os.path.join(tmp, "ckpt"), total_steps=400,
                      args=["--data", digits, "--out", out, "--lr", "0.05", "--step-sleep-s", "0.2"])
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    wait_for("training on n1", lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 3, 120, 0.2)
    pids = worker_pids(procs, 1)
    os.kill(n1.pid, signal.SIGSTOP)
    try:
        stopped = elasticctl("stop", JOB, "--grace-period-s", "1", endpoint=endpoint)
        assert stopped.returncode == 0, stopped
        assert (s := etcd.status(JOB)) is not None and s.state is JobState.STOPPED and s.stop_grace_s == 1.0, s
        # The Stop call's deadline (the grace and the 10 s push timeout) passes while n1 is frozen.
        holds_for("the ranks untouched while n1 is frozen", lambda: worker_pids(procs, 1) == pids, 12.0, 0.5)
    finally:
        os.kill(n1.pid, signal.SIGCONT)
    report = wait_for("generation 1 stopped on n1", lambda: (r := etcd.report(JOB, 1, "n1"))
                      and r.state.terminal and r, 60, 0.2)
    assert report.state is GenerationState.STOPPED, report
    wait_for("nothing of the generation left", lambda: not generation_processes(procs, 1), 15)
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:
        leader = f.read()
    assert "stopping generation 1 on n1: the job is STOPPED" in leader, leader[-3000:]
    assert "stopping generation 1 again on n1: the job is STOPPED" in leader, leader[-3000:]
    assert (s := etcd.status(JOB)) is not None and s.state is JobState.STOPPED


def test_elasticd_stopped_with_its_jobs_and_started_again_is_a_planned_relaunch_not_a_failure(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    """Two stops of elasticd with its jobs under a running job (a real SIGINT, Ctrl-C, then
    elasticd started again): each time the ranks checkpoint at a step and exit, elasticd's last
    report says so before its registration goes, and the job resumes from exactly that step as a
    planned relaunch. At the end: SUCCEEDED at total_steps (max_restarts 1: counted, the restarts
    would have failed it), no restart counted, the node never blamed nor quarantined. The pause
    each costs (SIGINT to the next generation's first step) is printed. Each save takes 2 s
    (rank 0 writes nothing before), longer than the 1 s shutdown_grace_s given: the ranks get
    twice the longest save elasticd saw them take (#49; with 1 s they were killed inside the save
    at the stop step, unsaved, and the relaunch went back to the checkpoint before)."""
    tmp = str(tmp_path)
    work, out = os.path.join(tmp, "work"), os.path.join(tmp, "out")
    endpoint = start_node(procs, etcd, namespace, work, "--shutdown-grace-s", "1")
    # (Two restarts take about 40 steps: enough left for the job to go on after the last one.)
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, out, os.path.join(tmp, "ckpt"), total_steps=60,
                      max_restarts=1, args=["--data", digits, "--out", out, "--lr", "0.05", "--save-s", "2"])
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    pauses = []
    for restart in range(2):
        g = etcd.plan(JOB).generation  # type: ignore[union-attr]
        # (Past a checkpoint this elasticd saw them take: a multiple of 10 crossed.)
        running = wait_for(f"generation {g} training", lambda: (r := etcd.report(JOB, g, "n0")) and
                           r.step >= max(r.resumed_step, 0) + 12 and r, 120, 0.2)
        daemon = procs.started[-1]
        t0 = time.monotonic()
        os.kill(daemon.pid, signal.SIGINT)
        assert daemon.wait(timeout=60) == 0
        stopped = etcd.report(JOB, g, "n0")
        assert stopped is not None and stopped.state is GenerationState.STOPPED, stopped
        assert stopped.cause is FailureCause.AGENT_SHUTDOWN and stopped.exit_step >= running.step, stopped
        with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:  # (each elasticd's lines, appended)
            assert f.read().count("a job's checkpoints took longer here than shutdown_grace_s: its ranks get") == \
                restart + 1
        start_node(procs, etcd, namespace, work, "--shutdown-grace-s", "1")
        resumed = wait_for(f"generation {g + 1} first step", lambda: (r := etcd.report(JOB, g + 1, "n0"))
                           and r.first_step_at and r, 120, 0.2)
        pauses.append(time.monotonic() - t0)
        plan = etcd.plan(JOB)
        assert plan is not None and plan.planned and plan.kind is RelaunchReason.ELASTICD_RESTART, plan
        assert plan.restart_count == 0 and resumed.resumed_step == stopped.exit_step, (restart, resumed)
    status = wait_for("the job to finish", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 300, 0.5)
    assert status.state is JobState.SUCCEEDED, status.message
    assert status.restart_count == 0 and status.generation == 3
    assert not status.node_failures and not status.quarantined_until, status
    print(f"PAUSES per stop and start (SIGINT -> next first step): {', '.join(f'{p:.1f}s' for p in pauses)}")

