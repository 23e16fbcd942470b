"""Recovery on a simulated cluster (network namespaces), for 2 and 4 nodes.

For each cluster size N (one worker per node) it prints, next to the lease TTL
and next to a plain-msrun cold start on the same namespaces (each fault once every training node's
standby workers are ready, as long after an earlier fault: whether each relaunch started warm is
printed too):

- rank kill -> first step of the next generation
- node loss (elasticd + workers SIGKILLed) -> new plan, and -> first step of it
- from 3 nodes: a node cut off (its veth down) -> new plan, and -> first step of it
- leader loss (a coordinator-only node SIGKILLed) -> new leader

Usage: python bench/cluster_recovery.py [--nodes 2 4]   (root: it creates namespaces)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mselastic.core.model import Event, GenerationReport  # noqa: E402
from mselastic.store.embedded import free_port  # noqa: E402
from tests.cluster import Cluster, ClusterFault  # noqa: E402
from tests.harness import (DATA_DIR, LENET, VENV_BIN, Processes, agent_status, elasticctl,  # noqa: E402
                           lenet_spec, wait_for, worker_pids)

TTL_S = 3
RECEIVER = """
import socket, sys, json
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind("\\0" + sys.argv[1])
s.settimeout(300)
while True:
    b = json.loads(s.recv(4096))
    if b["kind"] == "step":
        print(b["at"], flush=True)
        break
"""


def plain_cold_start(cluster: Cluster, n: int, tmp: str) -> float:
    """Plain msrun on every namespace (no daemon): start -> first step, as rank 0 reports it."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    receiver = subprocess.Popen(["ip", "netns", "exec", cluster.nodes[0], sys.executable, "-c", RECEIVER, name],
                                stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    port = free_port()
    env = {"MSELASTIC_HEARTBEAT": name, "MSELASTIC_CHECKPOINT_DIR": os.path.join(tmp, f"plain-ckpt-{n}"),
           "MSELASTIC_TOTAL_STEPS": "20", "MSELASTIC_GLOBAL_BATCH_SIZE": "24"}
    started = time.time()
    procs = []
    for i in range(n):
        cmd = ["ip", "netns", "exec", cluster.nodes[i], os.path.join(VENV_BIN, "msrun"), f"--worker_num={n}",
               "--local_worker_num=1", f"--node_rank={i}", f"--master_addr={cluster.address(0)}",
               f"--master_port={port}", f"--log_dir={tmp}/plain-{n}-{i}", "--join=True", "--tail_worker_log=99999",
               LENET, "--data", DATA_DIR, "--out", f"{tmp}/plain-out"]
        procs.append(cluster.procs.start(f"plain-msrun-{n}-{i}", cmd, env=env))
    try:
        first = float(receiver.communicate(timeout=300)[0].strip())
        return first - started
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def report(cluster: Cluster, job: str, g: int, node: str) -> GenerationReport | None:
    assert cluster.etcd is not None
    return cluster.etcd.report(job, g, node)


def generation_event_at(cluster: Cluster, job: str, g: int) -> float:
    assert cluster.etcd is not None
    events = [Event.from_json(v) for v in cluster.etcd.prefix(cluster.etcd.keys.events(job)).values()]
    return next(e.at for e in events if e.kind == "generation" and e.generation == g)


def standbys_ready(cluster: Cluster, job: str, nodes: range) -> None:
    """Wait until each of ``nodes`` keeps its full pool of ready standbys (one per local worker and
    one for a scheduler), replaced after an earlier relaunch used them."""
    def ready(i: int) -> bool:
        return len([s for s in agent_status(cluster.endpoint(i)).standbys if s.job == job and s.ready]) >= 2
    wait_for("standbys ready", lambda: all(ready(i) for i in nodes), 300, 0.5)


def measure(n: int, tmp: str) -> dict[str, float]:
    procs = Processes(uuid.uuid4().hex, tmp)
    cluster = Cluster(procs, tmp, f"/bench-{uuid.uuid4().hex[:6]}", lease_ttl_s=TTL_S)
    try:
        cluster.up(n + 1)  # node 0 coordinates only; nodes 1..n train
        cluster.warm = True  # standby workers, as elasticd's default (the tests' clusters keep none)
        cluster.start_node(0, slots=0)
        assert cluster.etcd is not None
        etcd = cluster.etcd
        wait_for("n0 to lead", lambda: etcd.leader() == "n0", 30)
        cluster.start_nodes(*range(1, n + 1))
        out: dict[str, float] = {}
        job = "lenet"
        spec = lenet_spec(os.path.join(tmp, "job.toml"), job, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                          400, workers=1, min_nodes=1, max_nodes=n, global_batch_size=24,
                          scale_up_settle_s=600)  # a healed node is not taken back during the bench
        assert elasticctl("submit", spec, endpoint=cluster.endpoint(0)).returncode == 0
        last = f"n{n}"
        wait_for("training", lambda: (r := report(cluster, job, 1, last)) and r.step >= 15, 300, 0.2)
        standbys_ready(cluster, job, range(1, n + 1))

        # 1. Rank kill (the last rank) -> first step of generation 2.
        victim = worker_pids(procs, 1)[n - 1]
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        second = wait_for("gen 2 first step", lambda: (r := report(cluster, job, 2, "n1")) and r.first_step_at
                          and r, 300, 0.1)
        out["rank_kill_to_first_step_s"] = second.first_step_at - killed
        out["rank_kill_warm"] = float(second.warm)
        wait_for("training in gen 2", lambda: (r := report(cluster, job, 2, last)) and r.step >= 30, 300, 0.2)
        standbys_ready(cluster, job, range(1, n))  # (the survivors')

        # 2. Node loss: the last node's elasticd and workers.
        cluster.inject(ClusterFault.KILL_NODE, n)
        killed = time.time()
        third = wait_for("gen 3 first step", lambda: (r := report(cluster, job, 3, "n1")) and r.first_step_at
                         and r, 300, 0.1)
        out["node_loss_to_plan_s"] = generation_event_at(cluster, job, 3) - killed
        out["node_loss_to_first_step_s"] = third.first_step_at - killed
        out["node_loss_warm"] = float(third.warm)

        # 2b. A node cut off (its veth down: no reset, the leader's keepalive pings go unanswered),
        # when one is left to train without it.
        if n >= 3:
            wait_for("training in gen 3", lambda: (r := report(cluster, job, 3, "n1")) and r.step >= 40, 300, 0.2)
            standbys_ready(cluster, job, range(1, n - 1))
            cluster.inject(ClusterFault.PARTITION, n - 1)
            cut = time.time()
            fourth = wait_for("gen 4 first step", lambda: (r := report(cluster, job, 4, "n1")) and r.first_step_at
                              and r, 300, 0.1)
            out["partition_to_plan_s"] = generation_event_at(cluster, job, 4) - cut
            out["partition_to_first_step_s"] = fourth.first_step_at - cut
            out["partition_warm"] = float(fourth.warm)
            cluster.inject(ClusterFault.HEAL, n - 1)  # (the plain-msrun run below needs every namespace)
            cluster.wait_registered(n - 1, timeout_s=30)

        # 3. Leader loss: n0 holds no ranks.
        cluster.inject(ClusterFault.KILL_LEADER)
        killed = time.time()
        wait_for("a new leader", lambda: (ld := etcd.leader()) not in (None, "n0") and ld, 30, 0.02)
        out["leader_loss_to_new_leader_s"] = time.time() - killed
        assert elasticctl("stop", job, endpoint=cluster.endpoint(1)).returncode == 0
        procs.stop_all()
        # The plain-msrun baseline on the same namespaces, once the daemons are gone.
        out["cold_start_s"] = plain_cold_start(cluster, n, tmp)
        return out
    finally:
        cluster.down()
        left = procs.stop_all()
        if left:
            print(f"warning: leftovers {left}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    results = {}
    for n in args.nodes:
        tmp = tempfile.mkdtemp(prefix=f"mselastic-bench-{n}-")
        try:
            results[n] = measure(n, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"{n} nodes: " + ", ".join(f"{k}={v:.2f}" for k, v in results[n].items()), flush=True)
    print(f"\n{'':<30}" + "".join(f"{f'{n} nodes':>12}" for n in results) + f"{'TTL':>8}")
    rows = ["cold_start_s", "rank_kill_to_first_step_s", "rank_kill_warm", "node_loss_to_plan_s",
            "node_loss_to_first_step_s", "node_loss_warm", "partition_to_plan_s", "partition_to_first_step_s",
            "partition_warm", "leader_loss_to_new_leader_s"]  # (warm: 1 when the relaunch took standbys)
    for k in rows:
        print(f"{k:<30}" + "".join(f"{results[n][k]:>12.2f}" if k in results[n] else f"{'-':>12}" for n in results)
              + f"{TTL_S:>8}")
    for n in results:
        print(f"ratio rank kill -> first step / cold start, {n} nodes: "
              f"{results[n]['rank_kill_to_first_step_s'] / results[n]['cold_start_s']:.2f}")
    print("BENCH " + json.dumps({str(n): {k: round(v, 3) for k, v in r.items()} for n, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
