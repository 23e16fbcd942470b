"""What training costs under elasticd, and what the per-step snapshots cost, against plain msrun.

The LeNet job, 2 ranks, a checkpoint every 10 steps in every mode, side by side in one
invocation (the modes alternate within each round, ``--runs`` rounds, medians):

* plain: plain msrun, no daemon, no snapshots (the baseline);
* plain + snapshots: plain msrun with a snapshot of the training state every step (what
  ``snapshot_interval_steps = 1``, the default, costs the ranks: the parameters' bytes written to
  the node's memory, a tmpfs folder, on the training thread);
* elasticd: the job submitted to an elasticd with its defaults (snapshots every step, standby
  workers started once it trains, heartbeats, reports).

Milliseconds per step of rank 0 between ``--from-step`` and ``--to-step``, the same steps in every
mode (plain: the trainer's own heartbeat times; elasticd: rank 0's step as the agent reports it,
polled every 10 ms; its standbys must be ready before the window opens, so that it measures the
steady state, not their imports), and
each mode's ratio to the baseline (steps per second, so 1.00 is "costs nothing", < 1 slower):
the ratio of the medians, and the median of each round's own ratio (the modes of one round run
back to back, so a slow spell of the machine weighs on both sides of it) with its 95 % bootstrap
interval (whole rounds resampled): a cost inside it is one this machine cannot tell from noise.

Usage: make bench-steady   (or: python bench/steady_state.py --data build/data/digits --runs 3)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from localnode import LocalNode, bench_folder, plain_msrun, wait_for, write_lenet_spec  # noqa: E402

from mselastic.core import contract  # noqa: E402

MODES = ("plain", "plain + snapshots", "elasticd")


def plain(data: str, work: str, snapshots: bool, from_step: int, to_step: int) -> float:
    env = {contract.ENV_TOTAL_STEPS: str(to_step + 20), contract.ENV_CHECKPOINT_INTERVAL: "10",
           contract.ENV_GLOBAL_BATCH: "32"}
    if snapshots:
        folder = tempfile.mkdtemp(prefix="mselastic-bench-snap-", dir="/dev/shm")
        env.update({contract.ENV_SNAPSHOT_DIR: folder, contract.ENV_SNAPSHOT_INTERVAL: "1"})
    at: dict[int, float] = {}
    try:
        with plain_msrun(data, work, env) as job:
            while to_step not in at:
                beat = job.beat()
                if beat.kind == "step" and beat.rank == 0:
                    at[beat.step] = beat.at
    finally:
        if snapshots:
            shutil.rmtree(folder, ignore_errors=True)
    return (at[to_step] - at[from_step]) / (to_step - from_step) * 1000


def under_elasticd(data: str, work: str, from_step: int, to_step: int) -> float:
    with LocalNode(work).start() as node:
        spec = write_lenet_spec(os.path.join(work, "job.toml"), "bench", data, os.path.join(work, "out"),
                                os.path.join(work, "ckpt"), to_step + 20)
        assert node.elasticctl("submit", spec).returncode == 0
        wait_for("training", lambda: (r := node.ranks("bench")[1].get(0)) and r.step >= 1, 180, 0.1)
        # A standby per local rank and one for a scheduler, started once the job trains.
        wait_for("standbys ready", lambda: len([s for s in node.standbys("bench") if s.ready]) >= 3, 120, 0.2)
        if node.ranks("bench")[1][0].step >= from_step - 1:
            raise RuntimeError(f"the standbys were ready only after step {from_step}: raise --from-step")
        at: dict[int, float] = {}
        while to_step not in at:
            r = node.ranks("bench")[1].get(0)
            now = time.time()
            if r is not None and r.step in (from_step, to_step) and r.step not in at:
                at[r.step] = now
            elif r is not None and r.step > to_step:
                raise RuntimeError("missed the last step: the poll is too slow")
            time.sleep(0.01)
        return (at[to_step] - at[from_step]) / (to_step - from_step) * 1000


def _interval(base: list[float], other: list[float]) -> tuple[float, float]:
    """The 95 % bootstrap interval of the median paired ratio (scipy's, resampling whole rounds)."""
    if len(base) < 3:
        return float("nan"), float("nan")
    import numpy as np
    from scipy.stats import bootstrap

    ci = bootstrap((np.array(base), np.array(other)), lambda b, o, axis=-1: np.median(b / o, axis=axis),
                   paired=True, vectorized=True, n_resamples=10_000, method="percentile",
                   rng=np.random.default_rng(0)).confidence_interval
    return float(ci.low), float(ci.high)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--from-step", type=int, default=80, help="(after the standbys' imports under elasticd)")
    p.add_argument("--to-step", type=int, default=180)
    args = p.parse_args()
    results: dict[str, list[float]] = {m: [] for m in MODES}
    with bench_folder("steady") as root:
        for i in range(args.runs):
            for mode in MODES:
                work = os.path.join(root, f"{i}-{mode.replace(' ', '').replace('+', '-')}")
                ms = (under_elasticd(args.data, work, args.from_step, args.to_step) if mode == "elasticd" else
                      plain(args.data, work, mode != "plain", args.from_step, args.to_step))
                results[mode].append(ms)
                print(f"run {i + 1} {mode}: {ms:.1f} ms/step", flush=True)
    base = statistics.median(results["plain"])
    print(f"\n{'mode':<20}{'ms/step':>10}{'ratio':>8}{'paired':>8}{'95 % interval':>17}{'spread':>9}"
          "   (ratio: plain's ms/step over this one's, 1.00 = no cost; paired: median of the rounds' own"
          " ratios, and its bootstrap interval: the cost this machine's noise cannot tell from it; spread:"
          " this mode's slowest run over its fastest)")
    for mode in MODES:
        med = statistics.median(results[mode])
        paired = statistics.median(b / m for b, m in zip(results["plain"], results[mode]))
        low, high = _interval(results["plain"], results[mode])
        spread = max(results[mode]) / min(results[mode])
        print(f"{mode:<20}{med:>10.1f}{base / med:>8.3f}{paired:>8.3f}   [{low:.3f}, {high:.3f}]{spread:>9.3f}")
    print("BENCH " + json.dumps({m.replace(" + ", "_").replace(" ", "_") + "_ms_per_step":
                                 round(statistics.median(v), 2) for m, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
