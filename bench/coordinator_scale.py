"""What the leader's reconcile passes cost as the cluster grows.

For N simulated nodes (their records in a real etcd; no processes), one job spread over
all of them: spec, status, a committed plan of generation G, every node's report of G
(running) and of G-1 (stopped), and ``--old-generations`` older generations' reports —
history a pass must not read. A pass is what the leader does on every change: read the
cluster (``read_cluster``) and decide the job (``decide``). Prints the median of
``--passes`` passes per N, the ratio to the smallest N, the cost per node, and the pass
that decides a relaunch after one node's rank failed. With ``--devices D`` (default 8) the same
is measured side by side, in the same invocation, on nodes of D devices each (a rank per device:
D workers per node), the pass as the leader makes it then: the nodes less their devices set aside,
the devices each job holds, the decision, and the devices a relaunch's plan gets (issue #32).

There is no msrun here: the baseline is the smallest cluster, and the question is
whether the cost per node stays flat (linear growth) as N grows.

Then the live leader (``--live-nodes``, default 4000): the real coordinator leading (an
election won in the same etcd, its informer cache), while a separate writer process makes
every node report its progress once a second (batched transactions, as many agents would).
Printed for ``--live-seconds``: reconcile passes per second, the leader process's CPU, and
keys read from etcd per pass against watch changes applied per pass (reads must follow what
changed, not the cluster's size). Member addresses are 127.0.0.1 on a closed port: nothing
is ever pushed anywhere else.

Usage: python bench/coordinator_scale.py [--nodes 10 100 1000 2000] [--passes 10] [--live-nodes 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

from mselastic.core import devices as device_rules
from mselastic.core.model import GenerationReport, JobStatus, LeaderRecord, NodeRecord
from mselastic.core.planner import Action, PortRange, decide, make_plan
from mselastic.daemon import admission
from mselastic.core.spec import JobSpec
from mselastic.core.states import GenerationState, JobState
from mselastic.store.embedded import EmbeddedEtcd
from mselastic.store.etcd import Store
from mselastic.store.keys import Keys
from mselastic.daemon.coordinator import Coordinator, CoordinatorConfig
from mselastic.store.lease import Election
from mselastic.store.views import read_cluster

JOB = "bench"
G = 10  # the current generation


async def put_all(store: Store, items: list[tuple[str, str]], batch: int = 200) -> None:
    for i in range(0, len(items), batch):
        await asyncio.gather(*(store.put(k, v) for k, v in items[i:i + batch]))


async def populate(store: Store, n: int, old_generations: int, per_node: int) -> None:
    """``per_node``: devices a node has (a rank each); 0: none (a slot, a rank)."""
    k = store.keys
    ids = tuple(range(per_node))
    nodes = [NodeRecord(node_id=f"n{i:05d}", agent_address="127.0.0.1:9", host="127.0.0.1", slots=per_node or 1,
                        version="bench", device_kind="gpu" if ids else "", devices=ids) for i in range(n)]
    workers = per_node or 1
    spec = JobSpec(name=JOB, script="/s.py", checkpoint_dir="/c", workers_per_node=workers, min_nodes=1, max_nodes=n,
                   global_batch_size=n * workers)
    plan = device_rules.assign(make_plan(spec, nodes, G, 0, "bench", None, PortRange()),
                               {r.node_id: r for r in nodes}, {})
    items = [(k.node(r.node_id), r.to_json()) for r in nodes]
    items += [(k.spec(JOB), spec.to_json()), (k.plan(JOB), plan.to_json()),
              (k.status(JOB), JobStatus(JobState.RUNNING, generation=G).to_json())]
    for g in range(G - 1 - old_generations, G + 1):
        state = GenerationState.RUNNING if g == G else GenerationState.STOPPED
        items += [(k.report(JOB, g, r.node_id), GenerationReport(job=JOB, generation=g, node_id=r.node_id,
                                                                 state=state, step=100 * g, devices=ids).to_json())
                  for r in nodes]
    await put_all(store, items)


async def one_pass(store: Store) -> tuple[float, Action]:
    """What the leader's pass does for the job (see Coordinator.reconcile): the nodes less their
    devices set aside, the devices held, the decision, and a relaunch's devices."""
    started = time.perf_counter()
    cluster = await read_cluster(store)
    now = time.time()
    nodes = device_rules.usable(cluster.nodes, cluster.device_cordons, now)
    held = admission.devices_held(cluster, {})
    view = cluster.jobs[JOB]
    assert view.spec is not None
    d = decide(view.spec, view.status.state, view.plan, view.current_reports(), nodes, now=now, status=view.status,
               devices={n.node_id: n for n in nodes}, devices_held=held)
    return time.perf_counter() - started, d.action


async def measure(endpoint: str, n: int, old_generations: int, passes: int, per_node: int = 0) -> dict[str, float]:
    store = Store(endpoint, Keys(f"/bench-{n}-{per_node}"))
    try:
        t0 = time.perf_counter()
        await populate(store, n, old_generations, per_node)
        setup = time.perf_counter() - t0
        times = []
        for _ in range(passes):
            t, action = await one_pass(store)
            assert action is Action.NOTHING, action  # a healthy generation: nothing to do
            times.append(t)
        # One rank fails on the first node: the pass that decides the relaunch.
        k = store.keys
        first = "n00000"
        await store.put(k.report(JOB, G, first), GenerationReport(
            job=JOB, generation=G, node_id=first, state=GenerationState.FAILED, failed_rank=0, reason="bench",
            detected_at=time.time()).to_json())
        t_fail, action = await one_pass(store)
        assert action is Action.LAUNCH, action
        return {"pass_s": statistics.median(times), "fail_s": t_fail, "setup_s": setup}
    finally:
        await store.close()


async def write_progress(endpoint: str, namespace: str, n: int, seconds: float, batch: int = 100) -> None:
    """The simulated agents: every node's report of generation G gets a new step once a second."""
    store = Store(endpoint, Keys(namespace))
    k, tx = store.keys, store.tx
    step, end = 1000, time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            second = time.monotonic()
            step += 1
            for i in range(0, n, batch):
                ops = [tx.put(k.report(JOB, G, f"n{j:05d}").encode(), GenerationReport(
                    job=JOB, generation=G, node_id=f"n{j:05d}", state=GenerationState.RUNNING, step=step,
                    first_step_at=1.0).to_json().encode()) for j in range(i, min(n, i + batch))]
                await store.txn([], ops)
                # Spread the second's reports over the second.
                await asyncio.sleep(max(0.0, second + (i + batch) / n - time.monotonic()))
    finally:
        await store.close()


async def live(endpoint: str, n: int, seconds: float) -> dict[str, float]:
    namespace = f"/live-{n}"
    store = Store(endpoint, Keys(namespace))
    stop = asyncio.Event()
    writer = None
    try:
        await populate(store, n, 0, 0)
        term = await Election(store, LeaderRecord("bench", "127.0.0.1:9").to_json(), 30).campaign(stop)
        assert term is not None
        # (No liveness watch: these members have no agents, every one would be asked and lost.)
        coord = Coordinator(store, CoordinatorConfig("bench", "127.0.0.1:9", 30, progress_interval_s=10,
                                                     reconcile_interval_s=1.0, peer_evidence=False))
        lead = asyncio.create_task(coord._lead(term, stop))
        writer = subprocess.Popen([sys.executable, __file__, "--writer", endpoint, namespace, str(n),
                                   str(seconds + 5)])
        await asyncio.sleep(3)  # the informer has listed; the writer is under way
        assert coord.informer is not None and coord.informer.synced.is_set()
        inf = coord.informer
        p0, c0, r0, ch0, t0 = coord.passes, time.process_time(), store.keys_read, inf.changes, time.monotonic()
        await asyncio.sleep(seconds)
        passes, cpu = coord.passes - p0, time.process_time() - c0
        reads, changes, wall = store.keys_read - r0, inf.changes - ch0, time.monotonic() - t0
        stop.set()
        await asyncio.wait_for(lead, 30)
        await term.lease.release()
        return {"passes_per_s": passes / wall, "cpu": cpu / wall, "reads_per_pass": reads / max(passes, 1),
                "changes_per_pass": changes / max(passes, 1), "changes_per_s": changes / wall,
                "pass_ms": cpu / max(passes, 1) * 1000, "lists": inf.lists}
    finally:
        if writer is not None:
            writer.terminate()
            writer.wait(timeout=30)
        await store.close()


async def run(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="mselastic-scale-") as tmp:
        etcd = EmbeddedEtcd(os.path.join(tmp, "etcd")).start()
        try:
            results = {n: await measure(etcd.endpoint, n, a.old_generations, a.passes) for n in a.nodes}
            with_devices = {n: await measure(etcd.endpoint, n, a.old_generations, a.passes, a.devices)
                            for n in a.nodes} if a.devices else {}
            live_results = {n: await live(etcd.endpoint, n, a.live_seconds) for n in a.live_nodes}
        finally:
            etcd.stop()
    base_n = min(a.nodes)
    base = results[base_n]["pass_s"]
    print(f"one reconcile pass (read_cluster, the nodes less their devices set aside, decide), median of {a.passes}; "
          f"{a.old_generations} older generations of reports stored but not read:")
    print(f"  {'nodes':>6}  {'pass ms':>8}  {'ratio':>6}  {'us/node':>8}  {'relaunch pass ms':>16}")
    for n in a.nodes:
        r = results[n]
        print(f"  {n:>6}  {r['pass_s'] * 1000:8.1f}  {r['pass_s'] / base:6.1f}  {r['pass_s'] / n * 1e6:8.0f}"
              f"  {r['fail_s'] * 1000:16.1f}")
    print(f"(ratio: against {base_n} nodes; linear growth keeps us/node flat)")
    if with_devices:
        print(f"\nthe same with {a.devices} devices a node (a rank each; the plan and every report name their "
              f"devices), side by side:")
        print(f"  {'nodes':>6}  {'devices':>7}  {'pass ms':>8}  {'without':>8}  {'ratio':>6}  {'relaunch pass ms':>16}"
              f"  {'without':>8}")
        for n in a.nodes:
            r, plain = with_devices[n], results[n]
            print(f"  {n:>6}  {n * a.devices:>7}  {r['pass_s'] * 1000:8.1f}  {plain['pass_s'] * 1000:8.1f}"
                  f"  {r['pass_s'] / plain['pass_s']:6.2f}  {r['fail_s'] * 1000:16.1f}  {plain['fail_s'] * 1000:8.1f}")
    if live_results:
        print(f"\nthe live leader (informer cache), every node reporting progress once a second, "
              f"{a.live_seconds:g} s:")
        print(f"  {'nodes':>6}  {'changes/s':>9}  {'passes/s':>8}  {'leader CPU':>10}  {'CPU ms/pass':>11}"
              f"  {'keys read/pass':>14}  {'changes/pass':>12}  {'lists':>5}")
        for n, r in live_results.items():
            print(f"  {n:>6}  {r['changes_per_s']:9.0f}  {r['passes_per_s']:8.1f}  {r['cpu'] * 100:9.0f}%"
                  f"  {r['pass_ms']:11.1f}  {r['reads_per_pass']:14.2f}  {r['changes_per_pass']:12.0f}"
                  f"  {r['lists']:>5}")
        print("(keys read/pass: what a pass reads from etcd; the cache is listed once and then follows the watch)")
    return 0


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--writer":  # the simulated agents, in their own process
        endpoint, namespace, n, seconds = sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
        asyncio.run(write_progress(endpoint, namespace, n, seconds))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 1000, 2000])
    p.add_argument("--old-generations", type=int, default=5)
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--live-nodes", type=int, nargs="*", default=[4000])
    p.add_argument("--live-seconds", type=float, default=10.0)
    p.add_argument("--devices", type=int, default=8, help="devices a node has in the side-by-side run (0: none)")
    a = p.parse_args()
    if min(a.nodes) < 1 or a.old_generations < 0 or a.passes < 1 or a.old_generations > G - 2:
        p.error(f"--nodes >= 1, 0 <= --old-generations <= {G - 2}, --passes >= 1")
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
