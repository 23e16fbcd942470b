"""Several simulated nodes (network namespaces): the failure matrix across nodes."""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import psutil
import pytest

from mselastic.core import fencing
from mselastic.core.model import AGENT_RESTARTED, Event, GenerationReport
from mselastic.core.states import GenerationState, JobState
from tests.cluster import Cluster, ClusterFault
from tests.harness import DATA_DIR, LENET, REPO, Pace, check_history, elasticctl, holds_for, lenet_spec, \
    longest_step_gap, still_running, wait_for, worker_pids

pytestmark = pytest.mark.slow
JOB = "lenet"
LINGER = os.path.join(REPO, "tests", "linger.py")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def submit(cluster: Cluster, total_steps: int, pace: Pace | None = None, **overrides: object) -> None:
    if pace is not None:
        overrides["args"] = ["--data", DATA_DIR, "--out", os.path.join(cluster.tmp, "out"), "--lr", "0.05", *pace.args]
    spec = lenet_spec(os.path.join(cluster.tmp, "job.toml"), JOB, os.path.join(cluster.tmp, "out"),
                      os.path.join(cluster.tmp, "ckpt"), total_steps, workers=1,
                      **{"min_nodes": 1, "max_nodes": 2, **overrides})
    r = elasticctl("submit", spec, endpoint=cluster.endpoint(0))
    assert r.returncode == 0, r.stderr


def finished(cluster: Cluster, timeout_s: float = 300):  # type: ignore[no-untyped-def]
    etcd = cluster.etcd
    assert etcd is not None
    return wait_for("job to end", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, timeout_s, 0.5)


def _visible(pid: int) -> tuple[str, str, str]:
    """(CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES, DEVICE_ID) a rank was launched with ("-": unset)."""
    env = psutil.Process(pid).environ()
    return tuple(env.get(k, "-") for k in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "DEVICE_ID"))  # type: ignore[return-value]


def test_rank_kill_on_one_node_restarts_the_generation_everywhere(cluster: Cluster) -> None:
    """Also devices of two kinds (issue #32): n0 lists gpu devices 4-5, n1 ascend devices 0-1; each
    node's rank is launched with its kind's variable naming one of its devices (read from the rank's
    environment, in its node's namespace), the same again after the relaunch."""
    cluster.up(2)
    cluster.start_node(0, slots=2, extra=("--devices", "4-5", "--device-kind", "gpu"))
    cluster.wait_registered(0)
    cluster.start_node(1, slots=2, extra=("--devices", "0-1", "--device-kind", "ascend"))
    cluster.wait_registered(1)
    # Rank 1 (n1) is slow to exit at the end: it has said it finished and stays connected to the
    # scheduler on n0 for 4 s more. n0 must not end its generation (and the scheduler) before.
    lingered = os.path.join(cluster.tmp, "lingered")
    out = os.path.join(cluster.tmp, "out")
    pace = Pace(cluster.tmp, 0.3)  # until the kill's relaunch is planned: step 15 and a kill, on any machine
    submit(cluster, total_steps=30, script=LINGER,
           args=[LENET, "--data", DATA_DIR, "--out", out, "--lr", "0.05", *pace.args],
           env={"MSELASTIC_TEST_LINGER": f"1:4:{lingered}"})
    etcd = cluster.etcd
    assert etcd is not None
    plan1 = wait_for("generation 1", lambda: etcd.plan(JOB), 30)
    assert [m.node_id for m in plan1.members] == ["n0", "n1"] and plan1.master_addr == cluster.address(0)
    wait_for("step 15", lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 15, 180, 0.2)
    ranks = worker_pids(cluster.procs, 1)
    still_running(etcd, JOB, "the kill")
    assert sorted(ranks) == [0, 1]
    devices = {rank: _visible(pid) for rank, pid in ranks.items()}
    assert devices == {0: ("4", "-", "0"), 1: ("-", "0", "0")}, devices
    os.kill(ranks[1], signal.SIGKILL)  # rank 1 lives on n1
    killed = time.time()
    failed = wait_for("n1 reports FAILED", lambda: (r := etcd.report(JOB, 1, "n1"))
                      and r.state is GenerationState.FAILED and r, 5, 0.05)
    assert failed.detected_at - killed < 1.0 and failed.failed_rank == 1
    plan2 = wait_for("generation 2", lambda: (p := etcd.plan(JOB)) and p.generation == 2 and p, 15)
    assert [m.node_id for m in plan2.members] == ["n0", "n1"]  # same nodes, same order
    again = wait_for("generation 2's ranks", lambda: len(x := worker_pids(cluster.procs, 2)) == 2 and x, 60, 0.1)
    assert {rank: _visible(pid) for rank, pid in again.items()} == devices
    pace.release()
    wait_for("generation 1 gone on every node", lambda: not worker_pids(cluster.procs, 1), 15)
    n0 = wait_for("n0's generation 2 to end", lambda: (r := etcd.report(JOB, 2, "n0")) and r.state.terminal and r,
                  240, 0.05)
    n0_ended = time.time()
    wait_for("rank 1 to leave", lambda: os.path.exists(lingered), 30, 0.1)
    with open(lingered) as f:
        left = float(f.read())
    print(f"n0's generation ended {n0_ended - left:.2f}s after rank 1 (n1) left the scheduler")
    assert n0.state is GenerationState.SUCCEEDED and n0_ended > left, (n0, n0_ended, left)
    with open(os.path.join(cluster.procs.log_dir, "elasticd-n0.log")) as f:  # and it did not wait for msrun
        assert "gen=2 node=n0 rank=-: every rank finished and left the scheduler" in f.read()
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, 30)
    assert status.generation == 2
    for node in ("n0", "n1"):
        rep = etcd.report(JOB, 2, node)
        assert rep is not None and rep.state is GenerationState.SUCCEEDED and rep.step == 30


def test_node_loss_relaunches_without_the_node(cluster: Cluster) -> None:
    cluster.up(2)
    cluster.start_nodes(0, 1)
    pace = Pace(cluster.tmp, 0.3)  # until the relaunch is planned
    submit(cluster, total_steps=30, pace=pace, scale_up_settle_s=600)  # n1's return below does not scale up
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("step 15", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 15, 180, 0.2)
    still_running(etcd, JOB, "the node's loss")
    cluster.inject(ClusterFault.KILL_NODE, 1)  # elasticd and, through the parent-death chain, its workers
    killed = time.monotonic()
    # The leader's connection to n1's agent drops with it, and its address refuses connections,
    # which proves nothing (a firewall's REJECT says the same of a live node): the new plan comes
    # once n1's lease ran out and then its fencing deadline passed (without systemd to start n1's
    # elasticd again, which would say at once that it runs nothing).
    plan2 = wait_for("generation 2 without n1", lambda: (p := etcd.plan(JOB)) and p.generation == 2 and p, 40, 0.02)
    took = time.monotonic() - killed
    pace.release()
    bound = cluster.lease_ttl_s + fencing.fenced_within(cluster.lease_ttl_s) + 1.5
    assert took < bound, f"node loss -> new plan took {took:.2f}s (bound {bound:.1f}s)"
    assert took > fencing.fenced_within(cluster.lease_ttl_s), f"replaced after {took:.2f}s, before its deadline"
    assert etcd.get(etcd.keys.node("n1")) is None  # the lease decided, then the deadline
    assert [m.node_id for m in plan2.members] == ["n0"] and plan2.world_size == 1
    assert "node(s) lost: n1" in plan2.reason or "failed" in plan2.reason
    # n1 comes back: the report its killed elasticd left running is closed, so n1 is not shown busy.
    assert (old := etcd.report(JOB, 1, "n1")) is not None and not old.state.terminal
    cluster.start_nodes(1)
    closed = wait_for("n1's old report closed", lambda: (r := etcd.report(JOB, 1, "n1")) and r.state.terminal and r, 10)
    assert closed.state is GenerationState.FAILED and closed.reason == AGENT_RESTARTED
    nodes = json.loads(elasticctl("nodes", "-o", "json", endpoint=cluster.endpoint(0)).stdout)["nodes"]
    assert [n.get("running_jobs", []) for n in nodes if n["node_id"] == "n1"] == [[]], nodes
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, 30)
    rep = etcd.report(JOB, status.generation, "n0")
    assert rep is not None and rep.step == 30 and rep.resumed_step >= 10


def test_leader_loss_does_not_restart_a_healthy_generation(cluster: Cluster) -> None:
    cluster.up(3)
    cluster.start_node(0, slots=0)  # coordinator-only: the first to campaign, it leads
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("n0 to lead", lambda: etcd.leader() == "n0", 30)
    cluster.start_nodes(1, 2)
    pace = Pace(cluster.tmp, 0.3)  # until the new leader has left the generation alone (about 6 s)
    submit(cluster, total_steps=40, pace=pace)
    wait_for("step 10", lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 10, 180, 0.2)
    before = worker_pids(cluster.procs, 1)
    assert sorted(before) == [0, 1]
    still_running(etcd, JOB, "the leader's loss")
    cluster.inject(ClusterFault.KILL_LEADER)
    killed = time.monotonic()
    new = wait_for("a new leader", lambda: (ld := etcd.leader()) not in (None, "n0") and ld,
                   cluster.lease_ttl_s + 1, 0.05)
    assert time.monotonic() - killed <= cluster.lease_ttl_s + 1 and new in ("n1", "n2")
    # The new leader reconciles from etcd and leaves the healthy generation alone.
    wait_for("training to go on under the new leader",
             lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 25, 120, 0.2)
    still_running(etcd, JOB, "the check under the new leader")
    assert worker_pids(cluster.procs, 1) == before
    pace.release()
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, 40)
    assert status.generation == 1 and status.restart_count == 0


def test_partitioned_node_fences_itself_and_rejoins_when_healed(cluster: Cluster) -> None:
    cluster.up(2)
    cluster.start_nodes(0, 1)
    pace = Pace(cluster.tmp, 0.3)  # until the relaunch is planned
    submit(cluster, total_steps=30, pace=pace)
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("step 15", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 15, 180, 0.2)
    on_n1 = {r: p for r, p in worker_pids(cluster.procs, 1).items() if r == 1}
    still_running(etcd, JOB, "the partition")
    assert on_n1
    cluster.inject(ClusterFault.PARTITION, 1)
    cut, cut_at = time.monotonic(), time.time()
    # n1 cannot renew its lease: within a TTL it kills its own workers (self-fencing).
    wait_for("n1's workers to be killed by n1 itself",
             lambda: not any(_alive(p) for p in on_n1.values()), cluster.lease_ttl_s + 1, 0.05)
    assert time.monotonic() - cut <= cluster.lease_ttl_s + 0.3  # + polling
    deadline = cluster.lease_ttl_s + fencing.fenced_within(cluster.lease_ttl_s)
    plan2 = wait_for("generation 2 without n1", lambda: (p := etcd.plan(JOB)) and p.generation >= 2 and p,
                     deadline + 10)
    pace.release()
    assert [m.node_id for m in plan2.members] == ["n0"]
    # The leader cannot hear from n1 that it fenced: it waits for n1's fencing deadline, counted
    # from n1's lease running out (docs/DESIGN.md, "Fencing"), not a moment less.
    events = [Event.from_json(v) for v in etcd.prefix(etcd.keys.events(JOB)).values()]
    planned = next(e.at for e in events if e.kind == "generation" and e.generation == 2)
    assert fencing.fenced_within(cluster.lease_ttl_s) < planned - cut_at < deadline + 3, \
        f"partition -> new plan took {planned - cut_at:.2f}s"
    cluster.inject(ClusterFault.HEAL, 1)
    cluster.wait_registered(1, timeout_s=20)
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, 30)
    rep = etcd.report(JOB, status.generation, "n0")
    assert rep is not None and rep.step == 30


def test_a_node_the_leader_cannot_reach_but_that_renews_its_lease_keeps_the_job(cluster: Cluster) -> None:
    """The leader (n0, coordinator-only) loses its route to n1, which still reaches etcd and renews
    its lease. The leader cannot know that n1 stopped, so it replaces nothing (before, it relaunched
    on n2 at once while n1 trained on for up to 3 TTLs): the job trains on n1, which reports to
    etcd, and ends there in generation 1."""
    cluster.up(3)
    cluster.start_node(0, slots=0)
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("n0 to lead", lambda: etcd.leader() == "n0", 30)
    cluster.start_nodes(1, slots=2)
    pace = Pace(cluster.tmp, 0.3)  # until the window after the cut is over
    out = os.path.join(cluster.tmp, "out")
    spec = lenet_spec(os.path.join(cluster.tmp, "job.toml"), JOB, out, os.path.join(cluster.tmp, "ckpt"), 60,
                      workers=2, min_nodes=1, max_nodes=1,
                      args=["--data", DATA_DIR, "--out", out, "--lr", "0.05", *pace.args])
    assert elasticctl("submit", spec, endpoint=cluster.endpoint(0)).returncode == 0
    plan1 = wait_for("generation 1", lambda: etcd.plan(JOB), 30)
    assert [m.node_id for m in plan1.members] == ["n1"]
    cluster.start_nodes(2, slots=2)  # (once the job is placed on n1: it starts meanwhile)
    wait_for("step 10 on n1", lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 10, 180, 0.2)
    cluster.wait_registered(2)
    old = worker_pids(cluster.procs, 1)
    still_running(etcd, JOB, "the cut")
    assert len(old) == 2
    step = etcd.report(JOB, 1, "n1").step  # type: ignore[union-attr]
    cluster.cut(0, 1)
    try:
        holds_for("generation 1 kept on n1", lambda: still_running(etcd, JOB, "the window after the cut")
                  and (p := etcd.plan(JOB)) and p.generation == 1 and worker_pids(cluster.procs, 1) == old,
                  3 * cluster.lease_ttl_s, 0.5)
        assert etcd.get(etcd.keys.node("n1")) is not None  # its lease held all along
        assert (r := etcd.report(JOB, 1, "n1")) is not None and r.step > step  # its progress reaches etcd
    finally:
        pace.release()
        cluster.cut(0, 1, heal=True)
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED and status.generation == 1, status.message
    check_history(etcd, JOB, 60)


def test_a_rack_cut_from_etcd_but_not_from_its_peers_fences_itself(cluster: Cluster) -> None:
    """A rack of two nodes (n0, the leader, and n1, rank 0) loses its route to etcd but not to n2:
    n1 asks its peers; n0 cannot reach etcd either, but n2 can, so n1 is on the cut side and stops
    its workers within the TTL; n2 takes over the lead, finds n1 fenced (its agent runs nothing)
    and the job goes on without it (before, peers answering meant "etcd is down, train on", and n1
    trained on beside the relaunched job)."""
    cluster.up(3)
    cluster.start_node(0, slots=0)  # the coordinator, holding no ranks
    cluster.wait_registered(0)
    cluster.start_nodes(1, 2)
    # Paced (0.4 s a step) until the relaunch: generation 1 must still be training when n1 fences
    # itself (up to TTL + 1.5 s after the cut, while n1 and n2 go on together).
    pace = Pace(cluster.tmp, 0.4)
    submit(cluster, total_steps=50, pace=pace, scale_up_settle_s=3600)
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("step 15", lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 15, 180, 0.2)
    plan1 = etcd.plan(JOB)
    assert plan1 is not None and [m.node_id for m in plan1.members] == ["n1", "n2"]
    # n1 runs rank 0, the rank that writes checkpoints: cut it, so that the check below can fail.
    on_n1 = {r: p for r, p in worker_pids(cluster.procs, 1).items() if r == 0}
    still_running(etcd, JOB, "the cut")
    assert on_n1
    cluster.inject(ClusterFault.CUT_FROM_ETCD, 0)
    cluster.inject(ClusterFault.CUT_FROM_ETCD, 1)
    cut = time.monotonic()
    try:
        wait_for("n1's workers to be killed by n1 itself",
                 lambda: not any(_alive(p) for p in on_n1.values()), cluster.lease_ttl_s + 3, 0.05)
        assert time.monotonic() - cut <= cluster.lease_ttl_s + 1.5
        plan2 = wait_for("generation 2 without n1", lambda: (p := etcd.plan(JOB)) and p.generation >= 2 and p, 20)
        assert [m.node_id for m in plan2.members] == ["n2"]
        assert etcd.leader() == "n2"
        with open(os.path.join(cluster.procs.log_dir, "elasticd-n1.log")) as f:
            assert "self-fencing: etcd is reachable from a peer but not from here: reachable from n2" in f.read()
    finally:
        pace.release()
        cluster.inject(ClusterFault.RECONNECT_ETCD, 0)
        cluster.inject(ClusterFault.RECONNECT_ETCD, 1)
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, 50)
    # No checkpoint of generation 1 was committed after generation 2 was (the fenced node's ranks
    # were gone before the relaunch).
    committed = next(json.loads(v)["at"] for v in etcd.prefix(etcd.keys.events(JOB)).values()
                     if json.loads(v)["kind"] == "generation" and json.loads(v)["generation"] == 2)
    ckpt = os.path.join(cluster.tmp, "ckpt")
    for path in glob.glob(os.path.join(ckpt, "*.json")):
        with open(path) as f:
            m = json.load(f)
        if m.get("generation") == 1:
            assert os.path.getmtime(path) <= committed, f"{path} written by generation 1 after generation 2"


def test_etcd_stall_and_outage_leave_a_healthy_job_alone(cluster: Cluster) -> None:
    """etcd frozen for 2 x TTL (SIGSTOP: a stalled fsync, a long pause; when it resumes every lease
    has expired at once), then stopped until both nodes are past their leases and train on by the
    peer rule: the same generation trains on with the same worker pids through both; the nodes
    register again and the coordinator adopts the generation."""
    cluster.up(2)
    cluster.start_nodes(0, 1)
    # Paced (0.3 s a step) until both faults are over: the sequence takes about 25 s, the 150 steps
    # after step 10 at least 45 s on any machine; then the job finishes at full speed.
    pace = Pace(cluster.tmp, 0.3)
    submit(cluster, total_steps=160, pace=pace)
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("step 10", lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 10, 180, 0.2)
    before = worker_pids(cluster.procs, 1)
    for fault, back in ((ClusterFault.FREEZE_ETCD, ClusterFault.THAW_ETCD),
                        (ClusterFault.STOP_ETCD, ClusterFault.START_ETCD)):
        step_before = max(r.step for n in ("n0", "n1") if (r := etcd.report(JOB, 1, n)))
        still_running(etcd, JOB, fault.value)
        cluster.inject(fault)
        # Training goes on while etcd is away: the ranks keep running (checked by their pids).
        running = lambda: worker_pids(cluster.procs, 1) == before  # noqa: E731
        if fault is ClusterFault.FREEZE_ETCD:  # etcd's own clock must see every lease expire
            holds_for(f"the workers running ({fault.value})", running, 2 * cluster.lease_ttl_s, 0.5)
        else:
            # Stopped only until both nodes are past their leases and train on by the peer rule:
            # an outage has its grace (fencing.outage_grace_s past the lease), and a loaded machine's
            # etcd restart must not eat into it (a fixed 2 x TTL here and a slow restart once took
            # the outage past it, and the nodes rightly stopped their workers).
            wait_for("both nodes on the peer rule with the workers running",
                     lambda: (assert_holds(running(), "the workers running (stop_etcd)")
                              and all(peer_rule_rounds(cluster, n) >= 2 for n in (0, 1))), 4 * cluster.lease_ttl_s, 0.2)
        cluster.inject(back)
        # The daemons reconnect and report progress made meanwhile; nothing was relaunched.
        wait_for(f"progress reported after {back.value}",
                 lambda: (r := etcd.report(JOB, 1, "n0")) and r.step > step_before + 10, 60, 0.5)
        still_running(etcd, JOB, f"the check after {back.value}")
        assert worker_pids(cluster.procs, 1) == before
        assert (p := etcd.plan(JOB)) is not None and p.generation == 1
        wait_for("both nodes registered", lambda: all(etcd.get(etcd.keys.node(n)) for n in ("n0", "n1")), 10, 0.2)
    pace.release()
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, 160)
    assert status.generation == 1 and status.restart_count == 0
    # The stall did what it does: both leases expired with etcd, and the generation was kept.
    for i in (0, 1):
        with open(os.path.join(cluster.procs.log_dir, f"elasticd-n{i}.log")) as f:
            assert "registration lease expired with etcd" in f.read(), f"n{i}'s lease did not expire in the stall"


PEER_RULE = "training goes on: etcd is unreachable from every peer too"


def peer_rule_rounds(cluster: Cluster, node: int) -> int:
    """How many times elasticd of ``node`` has gone by the peer rule (logged as the rule changes)."""
    with open(os.path.join(cluster.procs.log_dir, f"elasticd-n{node}.log")) as f:
        return f.read().count(PEER_RULE)


def assert_holds(ok: bool, what: str) -> bool:
    assert ok, f"{what} stopped holding"
    return True


def test_below_min_nodes_too_long_fails_cleanly(cluster: Cluster) -> None:
    cluster.up(2)
    cluster.start_nodes(0, 1)
    submit(cluster, total_steps=200, min_nodes=2, max_nodes=2, min_nodes_timeout_s=6)
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("step 5", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 5, 180, 0.2)
    cluster.inject(ClusterFault.KILL_NODE, 1)
    # (n1 is replaced once its lease has been gone for its fencing deadline: it may be training.)
    waiting = wait_for("the job to wait for nodes", lambda: (s := etcd.status(JOB))
                       and s.state is JobState.RESTARTING and s,
                       cluster.lease_ttl_s + fencing.fenced_within(cluster.lease_ttl_s) + 10, 0.2)
    assert "min_nodes=2" in waiting.message and waiting.waiting_since > 0
    status = finished(cluster, timeout_s=30)
    assert status.state is JobState.FAILED and "min_nodes_timeout_s=6" in status.message
    assert status.updated_at - waiting.waiting_since >= 6
    # Nothing half-running: n0's workers of generation 1 are stopped too.
    wait_for("n0's workers stopped", lambda: not worker_pids(cluster.procs, 1), 15)


def test_node_failing_repeatedly_is_quarantined(cluster: Cluster) -> None:
    cluster.up(2)
    cluster.start_nodes(0, 1)
    # Rank 1 (on n1) exits with an error in generations 1 and 2: n1 is quarantined after 2 failures.
    submit(cluster, total_steps=20, quarantine_after_failures=2, quarantine_cooldown_s=600,
           env={"MSELASTIC_FAULT": "exit:rank=1:generation=1-2:step=5"})
    etcd = cluster.etcd
    assert etcd is not None
    plan3 = wait_for("generation 3", lambda: (p := etcd.plan(JOB)) and p.generation == 3 and p, 240, 0.5)
    assert [m.node_id for m in plan3.members] == ["n0"] and "quarantined: n1" in plan3.reason
    status = etcd.status(JOB)
    assert status is not None and status.node_failures == {"n1": 2} and status.quarantined_until["n1"] > time.time()
    shown = elasticctl("status", JOB, endpoint=cluster.endpoint(0)).stdout
    assert "quarantined: n1 (2 failures)" in shown
    final = finished(cluster)
    assert final.state is JobState.SUCCEEDED and final.generation == 3, final.message
    check_history(etcd, JOB, 20)
    rep = etcd.report(JOB, 3, "n0")
    assert rep is not None and rep.step == 20


def test_etcd_leader_member_frozen_then_killed_in_a_three_member_cluster(cluster: Cluster) -> None:
    """The member leading etcd frozen for 2 x TTL (the other two elect a leader and keep serving;
    the frozen one keeps its connections open and answers nothing), then the new leader killed:
    the same generation trains through both."""
    cluster.up(2, etcd_members=3)
    cluster.start_nodes(0, 1)
    pace = Pace(cluster.tmp, 0.4)  # until both faults are over (about 20 s; 90 steps after step 10: 36 s)
    submit(cluster, total_steps=100, pace=pace)
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("step 10", lambda: (r := etcd.report(JOB, 1, "n1")) and r.step >= 10, 180, 0.2)
    before = worker_pids(cluster.procs, 1)
    def report(node: str) -> GenerationReport | None:
        """The node's report, or None while etcd's members elect a leader (a read then may time out)."""
        from mselastic.store.etcd import PermanentError, TemporaryError

        try:
            return etcd.report(JOB, 1, node)
        except (TemporaryError, PermanentError):
            return None

    for fault in (ClusterFault.FREEZE_ETCD_LEADER, ClusterFault.KILL_ETCD_LEADER):
        step = wait_for("both reports readable", lambda: (rs := [report(n) for n in ("n0", "n1")]) and all(rs)
                        and max(r.step for r in rs), 30, 0.2)
        still_running(etcd, JOB, fault.value)
        cluster.inject(fault)
        if fault is ClusterFault.FREEZE_ETCD_LEADER:
            holds_for("the workers running while the etcd leader is frozen",
                      lambda: worker_pids(cluster.procs, 1) == before, 2 * cluster.lease_ttl_s, 0.5)
            cluster.inject(ClusterFault.THAW_ETCD)
        # The other two members elect a new leader; the daemons fail over to them.
        wait_for(f"progress reported after {fault.value}",
                 lambda: (r := report("n0")) and r.step > step + 10, 60, 0.5)
        still_running(etcd, JOB, f"the check after {fault.value}")
        assert worker_pids(cluster.procs, 1) == before
    pace.release()
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, 100)
    assert status.generation == 1 and status.restart_count == 0


def test_restarts_exhausted_fails_with_nothing_left_anywhere(cluster: Cluster) -> None:
    cluster.up(2)
    cluster.start_nodes(0, 1)
    submit(cluster, total_steps=60, max_restarts=1, env={"MSELASTIC_FAULT": "exit:rank=1:generation=1-2:step=5"})
    status = finished(cluster, timeout_s=240)
    assert status.state is JobState.FAILED and "restarts exhausted (max_restarts=1)" in status.message
    assert status.generation == 2
    failure = status.last_failure
    assert failure is not None and failure.node_id == "n1" and failure.rank == 1, failure
    etcd = cluster.etcd
    assert etcd is not None
    survivor = wait_for("n0's generation 2 to end", lambda: (r := etcd.report(JOB, 2, "n0")) and r.state.terminal
                        and r, 15, 0.1)
    # Rank 0, its peer dead, cannot reach a step to checkpoint at: killed at once, not given the
    # stop_grace_period_s (5 s here) that it used to wait out in its broken allreduce.
    assert survivor.stopped_at - failure.detected_at < 3, (survivor, failure)
    wait_for("no worker of any generation left on any node",
             lambda: not worker_pids(cluster.procs, 1) and not worker_pids(cluster.procs, 2), 15)


def test_joining_node_leaves_the_generation_alone_and_is_used_at_the_next_relaunch(cluster: Cluster) -> None:
    cluster.up(2)
    cluster.start_nodes(0)
    # Paced (0.5 s a step) until the kill: the join, the 2 s window and step 11 take about 8 s,
    # the 35 steps after step 5 at least 17 s on any machine.
    pace = Pace(cluster.tmp, 0.5)
    submit(cluster, total_steps=40, pace=pace)
    etcd = cluster.etcd
    assert etcd is not None
    plan1 = wait_for("generation 1", lambda: etcd.plan(JOB), 30)
    assert [m.node_id for m in plan1.members] == ["n0"]
    wait_for("step 5", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 5, 180, 0.2)
    before = worker_pids(cluster.procs, 1)
    cluster.inject(ClusterFault.JOIN, 1)  # joins while generation 1 runs (scale_up_settle_s is 30 s)
    holds_for("generation 1 untouched by the join", lambda: still_running(etcd, JOB, "the join's window ended")
              and (p := etcd.plan(JOB)) and p.generation == 1 and worker_pids(cluster.procs, 1) == before, 2.0)
    # The next relaunch (rank 0 killed past the checkpoint of step 10) takes the newcomer in,
    # appended after the survivor.
    wait_for("step 11", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 11, 60, 0.1)
    still_running(etcd, JOB, "the kill")
    os.kill(before[0], signal.SIGKILL)
    plan2 = wait_for("generation 2", lambda: (q := etcd.plan(JOB)) and q.generation == 2 and q, 30, 0.1)
    assert [m.node_id for m in plan2.members] == ["n0", "n1"] and plan2.world_size == 2
    pace.release()
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED, status.message
    check_history(etcd, JOB, 40)
    resumed = {n: r.resumed_step for n in ("n0", "n1") if (r := etcd.report(JOB, 2, n)) and r.step == 40}
    assert len(resumed) == 2 and len(set(resumed.values())) == 1 and min(resumed.values()) >= 10


#: test_the_leaders_and_a_members_elasticd_restarted_leave_a_two_node_job_untouched: whose elasticd
#: (1: a member's, 0: the leader's, at first) stops how, in turn.
RESTARTS = ((1, signal.SIGKILL), (0, signal.SIGKILL), *((1, signal.SIGTERM), (0, signal.SIGTERM)) * 2)


def test_the_leaders_and_a_members_elasticd_restarted_leave_a_two_node_job_untouched(cluster: Cluster) -> None:
    """#45 across nodes: the job spans n0 and n1 (a rank each). n1's elasticd, then the leader's own
    (n0's), SIGKILLed (a crash), then each SIGTERMed (a restart) twice, in turn, and started
    again at once with the same command: each adopts its rank's generation (the leadership may
    move); the same worker pids on both nodes, generation 1 to the end, no restart counted, no gap
    between two steps of rank 0 longer than 2 x the step time + 1 s."""
    cluster.up(2)
    cluster.start_nodes(0, 1)
    pace = Pace(cluster.tmp, 0.3)
    out = os.path.join(cluster.tmp, "out")
    submit(cluster, total_steps=220, min_nodes=2,
           args=["--data", DATA_DIR, "--out", out, "--lr", "0.05", "--record-samples", *pace.args])
    etcd = cluster.etcd
    assert etcd is not None
    wait_for("step 5 on both", lambda: all((r := etcd.report(JOB, 1, n)) and r.step >= 5 for n in ("n0", "n1")),
             180, 0.2)
    pids = worker_pids(cluster.procs, 1)
    assert len(pids) == 2

    since = time.time()
    for i, sig in RESTARTS:
        still_running(etcd, JOB, f"n{i}'s {sig.name}")
        node = f"n{i}"
        step = etcd.report(JOB, 1, node).step  # type: ignore[union-attr]
        assert cluster.kill_node(i, sig) == (0 if sig == signal.SIGTERM else -sig)
        cluster.start_node(i)
        wait_for(f"{node}'s progress reported again",
                 lambda: (r := etcd.report(JOB, 1, node)) and r.step > step + 3, 60, 0.2)
        assert worker_pids(cluster.procs, 1) == pids
        assert (p := etcd.plan(JOB)) is not None and p.generation == 1
    until = time.time()
    pace.release()
    gap = longest_step_gap(os.path.join(out, "samples_g1_r0.jsonl"), since, until)
    print(f"adoption across nodes: rank 0's longest gap between two steps through {len(RESTARTS)} restarts: "
          f"{gap:.2f}s (steps paced at 0.3 s)")
    assert gap <= 2 * 0.3 + 1.0, gap
    status = finished(cluster)
    assert status.state is JobState.SUCCEEDED and status.generation == 1 and status.restart_count == 0, status
    for i in (0, 1):
        with open(os.path.join(cluster.procs.log_dir, f"elasticd-n{i}.log")) as f:
            log = f.read()
        assert log.count("generation adopted: msrun pid") == sum(1 for n, _ in RESTARTS if n == i), f"n{i}"
        assert log.count("generation left to its shim") == sum(1 for n, s in RESTARTS if n == i and s == signal.SIGTERM), \
            f"n{i}"
