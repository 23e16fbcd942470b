"""`make device-check`: on a node with NVIDIA GPUs (nvidia-smi) or Ascend NPUs (/dev/davinci<N>),
what mselastic detects there, and two jobs placed on it by elasticd with the real visible-devices
variables (issue #32).

Starts one elasticd (embedded etcd, ``devices = auto``), submits two jobs of half the devices'
ranks each, and has every rank record what it was launched with (``CUDA_VISIBLE_DEVICES`` or
``ASCEND_RT_VISIBLE_DEVICES``, and msrun's ``DEVICE_ID``): the device it trains on is the
``DEVICE_ID``-th of its visible list. Prints one line per rank, then ``RESULT ok`` when the two
jobs' devices are disjoint and every rank's device is one the node has, ``RESULT failed: ...``
(exit 1) otherwise, exit 2 where no device is detected. Everything it started is stopped on the way
out. The ranks only record and wait: no framework touches a device (the placement is the check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

from localnode import LocalNode, say, wait_for

from mselastic.agent.devices.detect import detect
from mselastic.agent.devices.xid import read_events
from mselastic.core.devices import VISIBLE, format_ids

#: A rank: what it was launched with, into OUT/<job>-<rank>.json; then it waits to be stopped.
RANK = """import json, os, sys, time
out = sys.argv[1]
env = os.environ
record = {k: env.get(k, "") for k in ("MSELASTIC_JOB", "RANK_ID", "DEVICE_ID", "CUDA_VISIBLE_DEVICES",
                                       "ASCEND_RT_VISIBLE_DEVICES")}
path = os.path.join(out, f"{record['MSELASTIC_JOB']}-{record['RANK_ID']}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
while True:
    time.sleep(1)
"""


def spec(path: str, name: str, script: str, out: str, ranks: int) -> str:
    with open(path, "w") as f:
        f.write(f'name = "{name}"\nscript = "{script}"\nargs = ["{out}"]\nworkers_per_node = {ranks}\n'
                f'min_nodes = 1\nmax_nodes = 1\ntotal_steps = 100\nglobal_batch_size = {ranks}\n'
                f'checkpoint_dir = "{out}/ckpt-{name}"\nstartup_timeout_s = 600\nhang_timeout_s = 600\n')
    return path


def xid_events(ids: tuple[int, ...]) -> str:
    """Which GPUs NVML gives critical Xid events for (what elasticd reads), or why none."""
    try:
        import pynvml
    except ImportError:
        return "not readable: nvidia-ml-py is not installed"
    said: list[str] = []
    stopped = threading.Event()

    def ready(gpus: list[int], failed: dict[int, str]) -> None:
        said.append(f"read for GPUs {format_ids(tuple(gpus)) or 'none'}"
                    + "".join(f"; GPU {g}: {why}" for g, why in sorted(failed.items())))
        stopped.set()

    try:
        read_events(pynvml, ids, lambda gpu, code: None, stopped, ready)
    except pynvml.NVMLError as e:
        return f"not readable: {e}"
    return said[0] if said else "not readable"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="", help="folder for elasticd and the ranks' records (default: a new one)")
    a = p.parse_args()
    kind, ids, how = detect()
    if not ids:
        print("RESULT no devices: neither nvidia-smi -L nor /dev/davinci* shows any on this node", file=sys.stderr)
        return 2
    say(f"detected {kind} devices {format_ids(ids)} ({how}); visible-devices variable {VISIBLE[kind]}")
    if kind == "gpu":
        say(f"NVML's Xid events: {xid_events(ids)}")
    per_job = max(1, len(ids) // 2)
    jobs = ["check-a", "check-b"] if len(ids) >= 2 else ["check-a"]
    work = a.work or tempfile.mkdtemp(prefix="mselastic-device-check-")
    out = os.path.join(work, "out")
    with LocalNode(os.path.join(work, "node")) as node:
        node.start("--devices", "auto", "--slots", str(len(ids)), "--warm-standbys", "false")
        os.makedirs(out, exist_ok=True)
        os.chmod(out, 0o1777)
        script = os.path.join(work, "rank.py")
        with open(script, "w") as f:
            f.write(RANK)
        os.chmod(script, 0o644)
        for job in jobs:
            r = node.elasticctl("submit", spec(os.path.join(work, f"{job}.toml"), job, script, out, per_job))
            if r.returncode:
                print(f"RESULT failed: submit {job}: {r.stderr.strip()}", file=sys.stderr)
                return 1
        want = {f"{job}-{rank}.json" for job in jobs for rank in range(per_job)}
        wait_for("every rank's record", lambda: want <= set(os.listdir(out)), 300, 0.5)
        print(node.elasticctl("nodes").stdout)
        used: dict[int, str] = {}
        problems = []
        for name in sorted(want):
            with open(os.path.join(out, name)) as f:
                rec = json.load(f)
            visible = [int(d) for d in rec[VISIBLE[kind]].split(",") if d]
            device = visible[int(rec["DEVICE_ID"])] if rec["DEVICE_ID"].isdigit() and \
                int(rec["DEVICE_ID"]) < len(visible) else -1
            print(f"job {rec['MSELASTIC_JOB']} rank {rec['RANK_ID']}: {VISIBLE[kind]}={rec[VISIBLE[kind]]} "
                  f"DEVICE_ID={rec['DEVICE_ID']} -> device {device}")
            if device not in ids:
                problems.append(f"{name[:-5]} is on no device of this node ({device})")
            elif device in used:
                problems.append(f"{name[:-5]} shares device {device} with {used[device]}")
            used[device] = name[:-5]
        for job in jobs:
            node.elasticctl("stop", job)
        time.sleep(1)
    if problems:
        print(f"RESULT failed: {'; '.join(problems)}")
        return 1
    print(f"RESULT ok: {len(used)} ranks of {len(jobs)} jobs on {len(used)} distinct {kind} devices of "
          f"{format_ids(ids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
