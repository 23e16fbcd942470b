"""What snapshots cost the training thread at 128 MiB and 1 GiB of state, before (one every step,
whatever it costs: ``snapshot_budget=None``) and after (at most ``SNAPSHOT_BUDGET`` of the
thread: the default), side by side in one invocation against the same loop without snapshots.

The state is a dense stack with Momentum's moments (4 x Dense(2048): 64 MiB of parameters, 128 MiB
with the moments; 8 x Dense(4096): 1 GiB); a training step is stood in for by ``--step-s`` of
sleep (the snapshot's cost is what is measured, not MindSpore's step). Printed per size: one
snapshot's cost, and the loop's time over ``--steps`` steps with snapshots every step and with
the budget, as ratios of the loop without them, with how many snapshots each kept.

Usage: make bench-snapshot   (or: python bench/snapshot_cost.py --steps 30 --step-s 0.2)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import mindspore as ms
from mindspore import nn

from mselastic.trainer.checkpoint import SNAPSHOT_BUDGET, Checkpointer


def loop(opt: nn.Optimizer, steps: int, step_s: float, budget: float | None, snapshots: bool) -> tuple[float, int]:
    """``steps`` steps of ``step_s``, each followed by a snapshot when ``snapshots``: (seconds, kept)."""
    work = tempfile.mkdtemp(prefix="mselastic-bench-snapcost-")
    shm = tempfile.mkdtemp(prefix="mselastic-bench-snapcost-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        ck = Checkpointer(os.path.join(work, "ckpt"), rank=0, world_size=1, generation=1, keep=2, snapshot_dir=shm,
                          snapshot_interval=1, keeper=True, snapshot_budget=budget)
        assert ck.load() is None  # claims the folder: snapshots continue its lineage
        kept, t = 0, time.perf_counter()
        for step in range(1, steps + 1):
            time.sleep(step_s)
            if snapshots:
                kept += ck.snapshot(opt, step, 0)
        return time.perf_counter() - t, kept
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def measure(name: str, net: nn.Cell, steps: int, step_s: float) -> dict[str, float]:
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    mib = sum(p.asnumpy().nbytes for p in opt.get_parameters()) / 2 ** 20
    bare, _ = loop(opt, steps, step_s, None, snapshots=False)
    every, every_kept = loop(opt, steps, step_s, None, snapshots=True)
    budgeted, budget_kept = loop(opt, steps, step_s, SNAPSHOT_BUDGET, snapshots=True)
    one = (every - bare) / steps
    res = {"mib": round(mib, 1), "snapshot_ms": round(one * 1e3, 1), "every_step_x": round(every / bare, 3),
           "budget_x": round(budgeted / bare, 3), "every_kept": every_kept, "budget_kept": budget_kept}
    print(f"{name:<26}{mib:>7.0f} MiB: a snapshot {one * 1e3:>6.1f} ms; {steps} steps of {step_s * 1e3:.0f} ms: "
          f"one every step x{res['every_step_x']:.3f} of the loop without them ({every_kept} kept), within the "
          f"{100 * SNAPSHOT_BUDGET:.0f} % budget x{res['budget_x']:.3f} ({budget_kept} kept: a crash costs up to "
          f"~{steps / max(budget_kept, 1):.0f} steps)", flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-s", type=float, default=0.2)
    a = p.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    results = {"128MiB": measure("4 x Dense(2048) + Momentum", nn.SequentialCell([nn.Dense(2048, 2048) for _ in range(4)]),
                                 a.steps, a.step_s),
               "1GiB": measure("8 x Dense(4096) + Momentum", nn.SequentialCell([nn.Dense(4096, 4096) for _ in range(8)]),
                               a.steps, a.step_s)}
    print("BENCH " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
