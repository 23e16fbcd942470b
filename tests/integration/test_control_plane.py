"""The control plane under load and under fire: jobs sharing slots, a stop racing a relaunch,
a job record that makes the coordinator raise, launches that cannot start, ranks frozen from
outside. Real etcd, real elasticd processes, real msrun and MindSpore workers, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from mselastic.core.model import GenerationReport, Member, Plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import FailureCause, GenerationState, JobState
from tests.cluster import Cluster
from tests.harness import DATA_DIR, LENET, TEST_MARK, VENV_BIN, Etcd, Processes, elasticctl, elasticd_cmd, \
    Sampler, generation_processes, holds_for, lenet_spec, local_socket, start_node, wait_for, worker_pids

pytestmark = pytest.mark.slow
JOB = "lenet"


def live_workers(mark: str) -> dict[str, int]:
    """Live MindSpore ranks started by this test, per node id (a rank's own children, such as data
    loaders, carry the same variables and are not counted)."""
    count: dict[str, int] = {}
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get(TEST_MARK) != mark or env.get("MS_ROLE") != "MS_WORKER" or p.status() == psutil.STATUS_ZOMBIE:
                continue
            parent = p.parent()
            if parent is not None and parent.environ().get("MS_ROLE"):
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        node = env.get("MSELASTIC_NODE_ID", "?")
        count[node] = count.get(node, 0) + 1
    return count


def most(sampler: Sampler) -> dict[str, int]:
    """The largest count of live ranks each node had in any sample."""
    peak: dict[str, int] = {}
    for _, seen in sampler.samples:
        for node, n in seen.items():
            peak[node] = max(peak.get(node, 0), n)
    return peak


def events(etcd: Etcd, job: str) -> list[dict[str, object]]:
    return sorted((json.loads(v) for v in etcd.prefix(etcd.keys.events(job)).values()), key=lambda e: e["at"])


def ended(etcd: Etcd, job: str, timeout_s: float = 240):  # type: ignore[no-untyped-def]
    return wait_for(f"job {job} to end", lambda: (s := etcd.status(job)) and s.state.terminal and s, timeout_s, 0.2)


def training(procs: Processes, etcd: Etcd, namespace: str, tmp: str) -> str:
    """n0 (2 slots) training a long LeNet job (2 ranks) past its second step; its endpoint."""
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "w0"))
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                      total_steps=2000)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    wait_for("training", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 2, 120, 0.2)
    return endpoint


def test_two_jobs_wanting_both_slots_of_a_node_take_turns(procs: Processes, etcd: Etcd, namespace: str,
                                                         tmp_path: os.PathLike[str], digits: str) -> None:
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"))  # n0, 2 slots
    # The second job's min_nodes_timeout_s is shorter than the first job's run: waiting in the queue
    # for slots another job holds is not a shortage of nodes, and must not fail it.
    specs = {job: lenet_spec(os.path.join(tmp, f"{job}.toml"), job, os.path.join(tmp, job, "out"),
                             os.path.join(tmp, job, "ckpt"), total_steps=5, workers=2, min_nodes_timeout_s=3)
             for job in ("first", "second")}
    with Sampler(lambda: live_workers(procs.mark)) as sampler:
        assert elasticctl("submit", specs["first"], endpoint=endpoint).returncode == 0
        wait_for("first placed", lambda: etcd.plan("first"), 20)
        assert elasticctl("submit", specs["second"], endpoint=endpoint).returncode == 0
        waiting = wait_for("second waiting with a reason", lambda: (s := etcd.status("second")) and "first" in
                           s.message and s, 20, 0.1)
        assert waiting.state is JobState.PENDING and "held by job(s) first" in waiting.message, waiting.message
        assert etcd.plan("second") is None
        first, second = ended(etcd, "first"), ended(etcd, "second")
    assert first.state is JobState.SUCCEEDED and second.state is JobState.SUCCEEDED, (first, second)
    assert most(sampler) == {"n0": 2}, f"live ranks on the 2-slot node peaked at {most(sampler)}"
    placed = [e for e in events(etcd, "second") if e["kind"] == "generation"]
    finished = [e for e in events(etcd, "first") if e["kind"] == "succeeded"]
    assert placed and finished and placed[0]["at"] >= finished[0]["at"], "second started before first ended"
    table = elasticctl("nodes", endpoint=endpoint).stdout
    assert "0/2" in table, table


def test_three_one_slot_jobs_on_two_nodes_start_in_submission_order(cluster: Cluster, digits: str) -> None:
    cluster.up(2)
    cluster.start_nodes(0, 1, slots=1)
    etcd = cluster.etcd
    assert etcd is not None
    jobs = ["j1", "j2", "j3"]
    with Sampler(lambda: live_workers(cluster.procs.mark)) as sampler:
        for job in jobs:
            out = os.path.join(cluster.tmp, job, "out")
            # j1 and j2 take a second a step: both slots still held when j3 is submitted, on any machine.
            spec = lenet_spec(os.path.join(cluster.tmp, f"{job}.toml"), job, out,
                              os.path.join(cluster.tmp, job, "ckpt"), total_steps=5, workers=1,
                              args=["--data", DATA_DIR, "--out", out, "--lr", "0.05",
                                    "--step-sleep-s", "1" if job != "j3" else "0"])
            r = elasticctl("submit", spec, endpoint=cluster.endpoint(0))
            assert r.returncode == 0, r.stderr
        queued = wait_for("j3 queued", lambda: (s := etcd.status("j3")) and "held by" in s.message and s, 20, 0.1)
        assert queued.state is JobState.PENDING and "held by job(s)" in queued.message, queued.message
        statuses = [ended(etcd, job) for job in jobs]
    assert [s.state for s in statuses] == [JobState.SUCCEEDED] * 3, [s.message for s in statuses]
    assert max(most(sampler).values()) == 1, f"live ranks per 1-slot node peaked at {most(sampler)}"
    started = {job: next(e["at"] for e in events(etcd, job) if e["kind"] == "generation") for job in jobs}
    done = {job: next(e["at"] for e in events(etcd, job) if e["kind"] == "succeeded") for job in jobs}
    assert started["j1"] < started["j2"] < started["j3"], started
    assert started["j3"] >= min(done["j1"], done["j2"]), "j3 started before a slot was free"


def test_a_stop_that_races_a_relaunch_is_not_undone(procs: Processes, etcd: Etcd, namespace: str,
                                                    tmp_path: os.PathLike[str], digits: str) -> None:
    """n0 coordinates (no slots), n1 trains. n1's elasticd is frozen (SIGSTOP) while the leader pushes
    a relaunch to it, and the operator stops the job meanwhile: the relaunch must never start."""
    tmp = str(tmp_path)
    ports = [free for free in (_free(), _free())]
    n0 = procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, ports[0], os.path.join(tmp, "w0"), namespace,
                                                 slots=0, lease_ttl_s=10, insecure=True))
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    n1 = procs.start("elasticd-n1", elasticd_cmd("n1", etcd.endpoint, ports[1], os.path.join(tmp, "w1"), namespace,
                                                 slots=2, lease_ttl_s=10, insecure=True))
    wait_for("n1 registered", lambda: etcd.get(etcd.keys.node("n1")), 30)
    endpoint = "unix:" + local_socket(os.path.join(tmp, "w0"))
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                      total_steps=400)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    wait_for("training", lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 3, 120, 0.2)
    stopper = None
    try:
        os.kill(n1.pid, signal.SIGSTOP)
        r = elasticctl("restart", JOB, endpoint=endpoint)
        assert r.returncode == 0, r.stderr
        wait_for("generation 2 committed (its push to n1 hangs)", lambda: (p := etcd.plan(JOB)) and p.generation == 2,
                 10, 0.05)
        stopper = subprocess.Popen([os.path.join(VENV_BIN, "elasticctl"), "--endpoint", endpoint, "stop", JOB],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for("STOPPED written", lambda: (s := etcd.status(JOB)) and s.state is JobState.STOPPED, 10, 0.05)
    finally:
        os.kill(n1.pid, signal.SIGCONT)
    assert stopper is not None
    _, err = stopper.communicate(timeout=60)
    assert stopper.returncode == 0, err
    wait_for("generation 1 gone", lambda: not generation_processes(procs, 1), 20)

    def still_stopped() -> bool:
        status, plan = etcd.status(JOB), etcd.plan(JOB)
        return bool(status and status.state is JobState.STOPPED and plan and plan.generation == 2
                    and not generation_processes(procs, 2) and etcd.report(JOB, 2, "n1") is None)
    holds_for("the stop (no generation started after it)", still_stopped, 6)
    kinds = [e["kind"] for e in events(etcd, JOB)]
    assert kinds.count("stopped") == 1 and "restart" in kinds, kinds
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:  # the agent refused the pushed relaunch
        assert "launch refused by n1: job lenet is STOPPED" in f.read()
    assert n0.poll() is None and n1.poll() is None


def test_a_node_that_refuses_the_leaders_pushes_fails_the_job_instead_of_leaving_it_running(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    """Two elasticds on loopback without TLS and without ``insecure``: n1 gives n0's plaintext push
    no node role (PERMISSION_DENIED). The job must not stay RUNNING with nothing running: it fails
    after ``denied_push_fail_s`` with the reason and what to configure."""
    tmp = str(tmp_path)
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, _free(), os.path.join(tmp, "w0"), namespace,
                                            slots=0, lease_ttl_s=10))
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    n1 = procs.start("elasticd-n1", elasticd_cmd("n1", etcd.endpoint, _free(), os.path.join(tmp, "w1"), namespace,
                                                 slots=2, lease_ttl_s=10))
    wait_for("n1 registered", lambda: etcd.get(etcd.keys.node("n1")), 30)
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                      total_steps=20)
    r = elasticctl("submit", spec, endpoint="unix:" + local_socket(os.path.join(tmp, "w0")))
    assert r.returncode == 0, r.stderr
    committed = wait_for("generation 1 committed", lambda: (p := etcd.plan(JOB)) and p.generation == 1 and p, 20, 0.05)
    assert committed.members[0].node_id == "n1"
    status = wait_for("FAILED", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 40, 0.2)
    assert status.state is JobState.FAILED, status
    assert "node n1 refused generation 1" in status.message and "PERMISSION_DENIED" in status.message, status.message
    assert "insecure_listen = true" in status.message, status.message
    assert etcd.report(JOB, 1, "n1") is None and not generation_processes(procs, 1)
    assert n1.poll() is None


def test_a_record_that_makes_the_coordinator_raise_stays_on_its_job(procs: Processes, etcd: Etcd, namespace: str,
                                                                     tmp_path: os.PathLike[str], digits: str) -> None:
    tmp = str(tmp_path)
    endpoint = training(procs, etcd, namespace, tmp)
    pids = worker_pids(procs, 1)
    # A job whose records are individually well-formed but together illegal: PENDING with a plan on
    # a node that is gone, so the planner waits and the status would go PENDING -> RESTARTING.
    bad = JobSpec(name="broken", script=LENET,
                  checkpoint_dir=os.path.join(tmp, "broken"))
    plan = Plan(job="broken", generation=1, members=(Member("ghost", 0, 1, "127.0.0.1:1", "127.0.0.1"),),
                world_size=1, master_addr="127.0.0.1", master_port=23456, restart_count=0, reason="test")
    put = [os.path.join(VENV_BIN, "etcdctl"), f"--endpoints={etcd.endpoint}", "put"]
    k = etcd.keys
    # (The ghost said in etcd that its generation ended: else the leader, which cannot know the
    # ghost stopped, would hold the job for fenced_within before deciding anything.)
    ended = GenerationReport(job="broken", generation=1, node_id="ghost", state=GenerationState.FAILED,
                             reason="gone")
    for key, value in ((k.spec("broken"), bad.to_json()), (k.plan("broken"), plan.to_json()),
                       (k.report("broken", 1, "ghost"), ended.to_json()),
                       (k.status("broken"), json.dumps({"state": "PENDING", "generation": 1}))):
        subprocess.run([*put, key, value], check=True, capture_output=True, timeout=20)

    def errors() -> list[dict[str, object]]:
        return [e for e in events(etcd, "broken") if e["kind"] == "error"]
    first = wait_for("the error shown on the broken job", errors, 10, 0.1)[0]
    assert "IllegalTransition" in str(first["message"]) and "PENDING -> RESTARTING" in str(first["message"]), first
    r = elasticctl("events", "broken", endpoint=endpoint)
    assert r.returncode == 0 and "reconcile error" in r.stdout, r.stdout + r.stderr
    shown = wait_for("the error as the job's status message", lambda: (s := etcd.status("broken")) and
                     "reconcile error" in s.message and s, 10, 0.1)
    assert shown.state is JobState.PENDING and "IllegalTransition" in shown.message  # the state is left alone
    holds_for("the other job training untouched, elasticd alive",
              lambda: worker_pids(procs, 1) == pids and procs.started[0].poll() is None, 4)
    assert (s := etcd.status(JOB)) is not None and s.state is JobState.RUNNING and s.generation == 1

    # Another elasticd taking over the lead meets the same record and does not crash either.
    n1 = procs.start("elasticd-n1", elasticd_cmd("n1", etcd.endpoint, _free(), os.path.join(tmp, "w1"), namespace,
                                                 slots=0))
    wait_for("n1 registered", lambda: etcd.get(etcd.keys.node("n1")), 30)
    os.kill(procs.started[0].pid, signal.SIGKILL)
    wait_for("n1 leading", lambda: etcd.leader() == "n1", 20)
    seen = len(errors())
    wait_for("n1 shows the error too", lambda: len(errors()) > seen, 15, 0.1)
    holds_for("n1 alive", lambda: n1.poll() is None, 3)


def test_launches_that_cannot_start_fail_at_once_with_the_path(procs: Processes, etcd: Etcd, namespace: str,
                                                               tmp_path: os.PathLike[str], digits: str) -> None:
    """A path Submit cannot judge (a checkpoint_dir in a folder that exists but where nothing can be
    made) fails the launch at once, naming it; a script that is not there, on the cluster's only
    node, is refused by Submit itself: one line, exit 1, nothing written."""
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "w0"))
    missing = os.path.join(tmp, "missing", "train.py")
    spec = lenet_spec(os.path.join(tmp, "bad-script.toml"), "bad-script", tmp, os.path.join(tmp, "c"), total_steps=10,
                      workers=1, script=missing)
    r = elasticctl("submit", spec, endpoint=endpoint)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"elasticctl: script {missing} does not exist on node n0, the cluster's only node: fix the path in the spec "
        f"(a relative path resolves against the spec file's folder)"), r.stderr
    assert etcd.status("bad-script") is None
    cases = {"bad-ckpt": ("checkpoint_dir", "/proc/nonexistent/ckpt")}
    for job, (field, path) in cases.items():
        spec = lenet_spec(os.path.join(tmp, f"{job}.toml"), job, os.path.join(tmp, job), os.path.join(tmp, job, "c"),
                          total_steps=10, workers=1, **{field: path})
        submitted = time.monotonic()
        assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
        status = ended(etcd, job, 10)
        took = time.monotonic() - submitted
        assert status.state is JobState.FAILED and path in status.message, status.message
        assert status.restart_count == 0 and status.generation == 1, status
        assert took < 10, f"{job} failed {took:.1f}s after submit"
        report = etcd.report(job, 1, "n0")
        assert report is not None and report.cause is FailureCause.LAUNCH_SPEC, report
        shown = elasticctl("describe", "job", job, endpoint=endpoint)
        assert shown.returncode == 0 and f"could not start on node n0: {field} {path}" in shown.stdout, shown


def test_a_rank_stopped_from_outside_is_blamed_within_the_hang_timeout(procs: Processes, etcd: Etcd, namespace: str,
                                                                       tmp_path: os.PathLike[str], digits: str) -> None:
    """SIGSTOP to one rank, once before its first step (while it imports MindSpore) and once
    after: found within hang_timeout_s + 2 s, not after startup_timeout_s, and blamed on it."""
    tmp = str(tmp_path)
    hang_s = 4
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "w0"))
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                      total_steps=400, hang_timeout_s=hang_s, startup_timeout_s=300)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    for generation, after_first_step in ((1, False), (2, True)):
        if after_first_step:
            wait_for(f"generation {generation} training",
                     lambda: (r := etcd.report(JOB, generation, "n0")) and r.step >= 2, 120, 0.1)
        victim = wait_for(f"rank 1 of generation {generation}", lambda: rank_pid(procs, generation, 1), 60, 0.02)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.time()
        failed = wait_for(f"generation {generation} failed",
                          lambda: (r := etcd.report(JOB, generation, "n0")) and r.state.terminal and r, hang_s + 10,
                          0.05)
        assert failed.state is GenerationState.FAILED and failed.failed_rank == 1, failed
        assert failed.cause is FailureCause.RANK_HUNG and "state T" in failed.reason, failed.reason
        assert (failed.first_step_at > 0) is after_first_step, failed
        assert failed.detected_at - stopped_at <= hang_s + 2, f"found {failed.detected_at - stopped_at:.1f}s after"
        wait_for("the stopped rank gone", lambda: not psutil.pid_exists(victim) or
                 psutil.Process(victim).status() == psutil.STATUS_ZOMBIE, 10)
    assert elasticctl("stop", JOB, endpoint=endpoint).returncode == 0


def test_without_a_hang_timeout_the_limits_are_learned_from_the_job_and_a_healthy_job_is_never_called_hung(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    """#47: no hang_timeout_s in the spec. The job (0.1 s of sleep a step) does what a healthy job
    does that a fixed short limit would call a hang: a first step of 10 s, a save of 2 s every 20
    steps (rank 0 writes, rank 1 waits for it), an evaluation of 3 s every 30 steps on rank 0 alone
    (unmarked: rank 1 waits in the next collective), and is not relaunched for it. Then rank 1 is
    SIGSTOPped: blamed on the limit learned from the steps (10 typical steps, at least 1 s), not the
    default's 30 s. (A deadlock, found once the whole job is idle past the learned limit and at
    least 30 s, is measured end to end by `make bench-hang`; what tells idle from working, by
    tests/integration/test_supervisor.py on real cgroups.)"""
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "w0"))
    out = os.path.join(tmp, "out")
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, out, os.path.join(tmp, "ckpt"), total_steps=400,
                      hang_timeout_s=0, checkpoint_interval_steps=20,
                      args=["--data", digits, "--out", out, "--lr", "0.05", "--step-sleep-s", "0.1", "--first-step-s",
                            "10", "--save-s", "2", "--eval-every", "30", "--eval-s", "3"])
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    wait_for("past two saves and an evaluation",
             lambda: (r := etcd.report(JOB, 1, "n0")) and (r.state.terminal or r.step >= 45), 180, 0.1)
    report = etcd.report(JOB, 1, "n0")
    assert report is not None and report.state is GenerationState.RUNNING, report
    victim = rank_pid(procs, 1, 1)
    assert victim is not None
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.time()
    failed = wait_for("generation 1 failed", lambda: (r := etcd.report(JOB, 1, "n0")) and r.state.terminal and r,
                      40, 0.05)
    assert failed.state is GenerationState.FAILED and failed.failed_rank == 1, failed
    assert failed.cause is FailureCause.RANK_HUNG and "state T" in failed.reason, failed.reason
    assert "learned: 10 typical steps" in failed.reason, failed.reason
    print(f"stopped rank found {failed.detected_at - stopped_at:.2f}s after its SIGSTOP: {failed.reason}")
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:
        log = f.read()
    assert "hang limits learned from the job: a stopped rank after" in log, log[-3000:]
    wait_for("generation 2", lambda: (s := etcd.status(JOB)) and s.generation >= 2 and s, 60, 0.1)
    assert elasticctl("stop", JOB, endpoint=endpoint).returncode == 0


def test_a_rank_stuck_before_init_is_blamed_once_its_peer_is_past_it(procs: Processes, etcd: Etcd, namespace: str,
                                                                    tmp_path: os.PathLike[str], digits: str) -> None:
    """Rank 1 never reaches init() (stuck as in a hung import), rank 0 waits inside init(): found
    within hang_timeout_s of rank 0's start-up phase, blamed on rank 1, not after startup_timeout_s."""
    tmp = str(tmp_path)
    hang_s = 4
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "w0"))
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                      total_steps=5, hang_timeout_s=hang_s, startup_timeout_s=300,
                      env={"MSELASTIC_FAULT": "stuck_startup:rank=1:generation=1:step=0"})
    submitted = time.time()
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    failed = wait_for("generation 1 failed", lambda: (r := etcd.report(JOB, 1, "n0")) and r.state.terminal and r,
                      60, 0.1)
    # Python start and `import mindspore` take a few seconds before rank 0 reports its phase.
    assert failed.detected_at - submitted < hang_s + 20, f"found {failed.detected_at - submitted:.1f}s after submit"
    assert failed.state is GenerationState.FAILED and failed.failed_rank == 1, failed
    assert failed.cause is FailureCause.RANK_HUNG and "before init()" in failed.reason, failed.reason
    plan = etcd.plan(JOB)
    assert plan is not None and plan.generation == 2
    status = ended(etcd, JOB)
    assert status.state is JobState.SUCCEEDED and status.generation == 2, status.message


def test_drain_of_the_only_node_fails_fast_with_the_reason(procs: Processes, etcd: Etcd, namespace: str,
                                                            tmp_path: os.PathLike[str], digits: str) -> None:
    tmp = str(tmp_path)
    endpoint = training(procs, etcd, namespace, tmp)
    pids = worker_pids(procs, 1)
    started = time.monotonic()
    r = elasticctl("drain", "n0", endpoint=endpoint)
    took = time.monotonic() - started
    assert r.returncode == 1 and "node n0 cannot be drained now: job lenet: drain of n0 waits" in r.stderr, r.stderr
    assert took < 15, f"drain took {took:.0f}s to say it cannot be done"
    assert worker_pids(procs, 1) == pids  # the job was left alone
    assert "Draining" in elasticctl("nodes", endpoint=endpoint).stdout
    assert elasticctl("uncordon", "n0", endpoint=endpoint).returncode == 0
    assert elasticctl("stop", JOB, endpoint=endpoint).returncode == 0


def test_a_forged_heartbeat_from_outside_the_generation_is_dropped(procs: Processes, etcd: Etcd, namespace: str,
                                                                    tmp_path: os.PathLike[str], digits: str) -> None:
    """Root (or, without job_uids, another job of the worker user) can reach the generation's
    heartbeat socket, and its path is public in /proc/net/unix. A 'finished' beat for rank 1 (it
    would hide rank 1's death), forged by a process that even carries the run id, is dropped (it is
    not in the generation's cgroup), and the kill is still found. (Another local user cannot send
    at all: tests/integration/test_containment.py.)"""
    from mselastic.core.contract import Beat, BeatKind

    tmp = str(tmp_path)
    endpoint = training(procs, etcd, namespace, tmp)
    victim = rank_pid(procs, 1, 1)
    assert victim is not None
    env = psutil.Process(victim).environ()
    forger = ("import os, socket, sys; from mselastic.core.contract import Beat; "
              "b = Beat(kind=sys.argv[1], rank=1, pid=os.getpid(), generation=1, step=2000); "
              "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.sendto(b.encode(), sys.argv[2]); "
              "print(os.getpid())")
    out = subprocess.run([sys.executable, "-c", forger, BeatKind.FINISHED.value, env["MSELASTIC_HEARTBEAT"]],
                         env={**os.environ, "MSELASTIC_RUN_ID": env["MSELASTIC_RUN_ID"]}, capture_output=True,
                         text=True, timeout=60, check=True)
    forger_pid = int(out.stdout)
    log_path = os.path.join(procs.log_dir, "elasticd-n0.log")

    def dropped() -> bool:
        with open(log_path) as f:
            return f"heartbeat from pid {forger_pid} (uid 0), not a process of this generation: dropped" in f.read()
    wait_for("the forged beat read and dropped", dropped, 10, 0.05)  # before the kill: it must not hide it
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    failed = wait_for("generation 1 failed", lambda: (r := etcd.report(JOB, 1, "n0")) and r.state.terminal and r, 10,
                      0.05)
    assert failed.state is GenerationState.FAILED and failed.failed_rank == 1, failed
    assert failed.detected_at - killed < 2, f"detected {failed.detected_at - killed:.1f}s after the kill"
    assert elasticctl("stop", JOB, endpoint=endpoint).returncode == 0


def rank_pid(procs: Processes, generation: int, rank: int) -> int | None:
    """The pid of one rank of a generation of JOB (msrun's child, not one of the rank's own children)."""
    for p in generation_processes(procs, generation):
        try:
            env = p.environ()
            parent = p.parent()
            if env.get("MS_ROLE") == "MS_WORKER" and env.get("RANK_ID") == str(rank) and \
                    parent is not None and not parent.environ().get("MS_ROLE"):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _free() -> int:
    from mselastic.store.embedded import free_port
    return free_port()
