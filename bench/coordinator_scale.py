"""What one reconcile pass of the leader costs as the cluster grows.

For N simulated nodes (their records in a real etcd; no processes), one job spread over
all of them: spec, status, a committed plan of generation G, every node's report of G
(running) and of G-1 (stopped), and ``--old-generations`` older generations' reports —
history a pass must not read. A pass is what the leader does on every change: read the
cluster (``read_cluster``) and decide the job (``decide``). Prints the median of
``--passes`` passes per N, the ratio to the smallest N, the cost per node, and the pass
that decides a relaunch after one node's rank failed.

There is no msrun here: the baseline is the smallest cluster, and the question is
whether the cost per node stays flat (linear growth) as N grows.

Usage: python bench/coordinator_scale.py [--nodes 10 100 1000 2000] [--passes 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

from mselastic.core.model import GenerationReport, JobStatus, NodeRecord
from mselastic.core.planner import Action, PortRange, decide, make_plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import GenerationState, JobState
from mselastic.store.embedded import EmbeddedEtcd
from mselastic.store.etcd import Store
from mselastic.store.keys import Keys
from mselastic.store.views import read_cluster

JOB = "bench"
G = 10  # the current generation


async def put_all(store: Store, items: list[tuple[str, str]], batch: int = 200) -> None:
    for i in range(0, len(items), batch):
        await asyncio.gather(*(store.put(k, v) for k, v in items[i:i + batch]))


async def populate(store: Store, n: int, old_generations: int) -> None:
    k = store.keys
    nodes = [NodeRecord(node_id=f"n{i:05d}", agent_address=f"10.0.{i // 250}.{i % 250}:7070",
                        host=f"10.0.{i // 250}.{i % 250}", slots=1, version="bench") for i in range(n)]
    spec = JobSpec(name=JOB, script="/s.py", checkpoint_dir="/c", workers_per_node=1, min_nodes=1, max_nodes=n,
                   global_batch_size=n)
    plan = make_plan(spec, nodes, G, 0, "bench", None, PortRange())
    items = [(k.node(r.node_id), r.to_json()) for r in nodes]
    items += [(k.spec(JOB), spec.to_json()), (k.plan(JOB), plan.to_json()),
              (k.status(JOB), JobStatus(JobState.RUNNING, generation=G).to_json())]
    for g in range(G - 1 - old_generations, G + 1):
        state = GenerationState.RUNNING if g == G else GenerationState.STOPPED
        items += [(k.report(JOB, g, r.node_id), GenerationReport(job=JOB, generation=g, node_id=r.node_id,
                                                                 state=state, step=100 * g).to_json())
                  for r in nodes]
    await put_all(store, items)


async def one_pass(store: Store) -> tuple[float, Action]:
    started = time.perf_counter()
    cluster = await read_cluster(store)
    view = cluster.jobs[JOB]
    assert view.spec is not None
    d = decide(view.spec, view.status.state, view.plan, view.current_reports(), cluster.nodes, now=time.time(),
               status=view.status)
    return time.perf_counter() - started, d.action


async def measure(endpoint: str, n: int, old_generations: int, passes: int) -> dict[str, float]:
    store = Store(endpoint, Keys(f"/bench-{n}"))
    try:
        t0 = time.perf_counter()
        await populate(store, n, old_generations)
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


async def run(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="mselastic-scale-") as tmp:
        etcd = EmbeddedEtcd(os.path.join(tmp, "etcd")).start()
        try:
            results = {n: await measure(etcd.endpoint, n, a.old_generations, a.passes) for n in a.nodes}
        finally:
            etcd.stop()
    base_n = min(a.nodes)
    base = results[base_n]["pass_s"]
    print(f"one reconcile pass (read_cluster + decide), median of {a.passes}; "
          f"{a.old_generations} older generations of reports stored but not read:")
    print(f"  {'nodes':>6}  {'pass ms':>8}  {'ratio':>6}  {'us/node':>8}  {'relaunch pass ms':>16}")
    for n in a.nodes:
        r = results[n]
        print(f"  {n:>6}  {r['pass_s'] * 1000:8.1f}  {r['pass_s'] / base:6.1f}  {r['pass_s'] / n * 1e6:8.0f}"
              f"  {r['fail_s'] * 1000:16.1f}")
    print(f"(ratio: against {base_n} nodes; linear growth keeps us/node flat)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 1000, 2000])
    p.add_argument("--old-generations", type=int, default=5)
    p.add_argument("--passes", type=int, default=10)
    a = p.parse_args()
    if min(a.nodes) < 1 or a.old_generations < 0 or a.passes < 1 or a.old_generations > G - 2:
        p.error(f"--nodes >= 1, 0 <= --old-generations <= {G - 2}, --passes >= 1")
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
