"""How long a checkpoint save holds training up: before (the save on the training thread, as the
lower-level ``Checkpointer.save`` does) and after (``mselastic.trainer.elastic``: the values copied,
the file written by a background thread), side by side in one invocation.

For each model (LeNet as the examples train it, and a 4 x 2048^2 dense stack of about 64 MiB of
float32, plus Momentum's moments), ``--saves`` saves of each kind into a fresh checkpoint folder:
the median time the training thread waits, and for the background writes the median time until
the checkpoint is complete (published in ``latest.json``). Then ``--snapshots`` snapshots
(``snapshot_interval_steps``): the parameters' raw bytes written to a folder in /dev/shm on the
training thread (complete when ``snapshot`` returns), and ``--saves`` more while a checkpoint is
written in the background (MindSpore writes one checkpoint at a time: a snapshot must not wait for
it). More snapshots than saves: a LeNet snapshot takes under a millisecond, where five samples
are noise.

Usage: make bench-checkpoint   (or: python bench/checkpoint_save.py --saves 5)
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

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.common.initializer import Normal


from mselastic.trainer.checkpoint import Checkpointer
from mselastic.trainer.elastic import Session


class LeNet5(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5, pad_mode="valid"), nn.Conv2d(6, 16, 5, pad_mode="valid")
        self.fc1, self.fc2 = nn.Dense(256, 120, weight_init=Normal(0.02)), nn.Dense(120, 84, weight_init=Normal(0.02))
        self.fc3 = nn.Dense(84, 10, weight_init=Normal(0.02))


def dense_stack() -> nn.Cell:
    return nn.SequentialCell([nn.Dense(2048, 2048) for _ in range(4)])


def measure(name: str, net: nn.Cell, saves: int, snapshots: int) -> dict[str, float]:
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    size = sum(p.asnumpy().nbytes for p in opt.get_parameters()) / 2 ** 20
    work = tempfile.mkdtemp(prefix="mselastic-bench-ckpt-")
    try:
        sync, blocking, complete = [], [], []
        ck = Checkpointer(os.path.join(work, "sync"), rank=0, world_size=1, generation=0, keep=2)
        for step in range(1, saves + 1):
            t = time.perf_counter()
            ck.save(opt, step, 0)
            sync.append(time.perf_counter() - t)
        s = Session()
        s.tracked, s.ckpt = [opt], Checkpointer(os.path.join(work, "async"), rank=0, world_size=1, generation=0,
                                                keep=2)
        for step in range(1, saves + 1):
            t = time.perf_counter()
            s.save(step)
            blocking.append(time.perf_counter() - t)
            s.wait_saved()
            complete.append(time.perf_counter() - t)
            with open(os.path.join(work, "async", "latest.json")) as f:
                assert json.load(f)["manifest"].startswith(f"ckpt-{step:08d}")
        # A snapshot (snapshot_interval_steps): the raw bytes, written to a folder in memory; then
        # again with a checkpoint being written in the background.
        snap_blocking, snap_during_save = [], []
        shm = tempfile.mkdtemp(prefix="mselastic-bench-snap-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        sk = Checkpointer(os.path.join(work, "snap-ckpt"), rank=0, world_size=1, generation=1, keep=2,
                          snapshot_dir=shm, snapshot_interval=1, keeper=True, snapshot_budget=None)
        assert sk.load() is None  # claims the folder: snapshots continue its lineage
        try:
            for step in range(1, snapshots + 1):
                t = time.perf_counter()
                assert sk.snapshot(opt, step, 0)
                snap_blocking.append(time.perf_counter() - t)
            first = max(snapshots, saves) + 1  # (past the snapshots' steps and the saves' above)
            for step in range(first, first + saves):
                s.save(step)
                t = time.perf_counter()
                assert sk.snapshot(opt, step, 0)
                snap_during_save.append(time.perf_counter() - t)
                s.wait_saved()
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"mib": size, "sync_s": statistics.median(sync), "blocking_s": statistics.median(blocking),
           "complete_s": statistics.median(complete), "snapshot_blocking_s": statistics.median(snap_blocking),
           "snapshot_during_save_s": statistics.median(snap_during_save)}
    print(f"{name:<24}{size:>8.1f} MiB   on the training thread: {res['sync_s'] * 1e3:>8.1f} ms before, "
          f"{res['blocking_s'] * 1e3:>7.1f} ms after (x{res['blocking_s'] / res['sync_s']:.2f}); "
          f"written in the background in {res['complete_s'] * 1e3:.1f} ms; a snapshot to memory: "
          f"{res['snapshot_blocking_s'] * 1e3:.1f} ms on the training thread, complete on return "
          f"({res['snapshot_during_save_s'] * 1e3:.1f} ms while a checkpoint is written)", flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--snapshots", type=int, default=50)
    args = p.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    results = {"lenet": measure("LeNet + Momentum", LeNet5(), args.saves, args.snapshots),
               "dense": measure("4 x Dense(2048) + Momentum", dense_stack(), args.saves, args.snapshots)}
    print("BENCH " + json.dumps({k: {m: round(v, 4) for m, v in r.items()} for k, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
