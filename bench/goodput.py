"""Goodput: the training a job gets done over a long run with a rank SIGKILLed every few minutes,
against the same run without faults, side by side in one invocation.

Both runs are the LeNet job (2 ranks) under an elasticd with its defaults (standby workers,
snapshots every step, a checkpoint every 10 steps). Each is measured over ``--minutes`` from its
first steps on (the first compile is not counted): the progress is the step the job's committed
trajectory reached at the end minus the one at the start, so steps recomputed after a crash do
not count. In the faulty run rank 1 is SIGKILLed every ``--kill-every-s`` seconds. Goodput is the
faulty run's progress over the fault-free run's (goal: >= 0.90 with a kill every 2 minutes).

Usage: make bench-goodput   (or: python bench/goodput.py --data build/data/digits --minutes 10)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from localnode import LocalNode, bench_folder, wait_for, write_lenet_spec  # noqa: E402


def step_now(node: LocalNode) -> int:
    """The job's step: rank 0's, as its agent reports it (waiting out a relaunch, if one is on)."""
    r = wait_for("a rank reporting", lambda: node.ranks("bench")[1].get(0), 120, 0.05)
    return int(r.step)


def run(data: str, work: str, seconds: float, kill_every_s: float) -> dict[str, float]:
    with LocalNode(work).start() as node:
        # (Every kill is blamed on the one node: it must not be quarantined or run out of restarts.)
        spec = write_lenet_spec(os.path.join(work, "job.toml"), "bench", data, os.path.join(work, "out"),
                                os.path.join(work, "ckpt"), 10_000_000, max_restarts=1000,
                                quarantine_after_failures=1000)
        assert node.elasticctl("submit", spec).returncode == 0
        wait_for("training", lambda: (r := node.ranks("bench")[1].get(0)) and r.step >= 5, 180, 0.1)
        start, first = time.monotonic(), step_now(node)
        kills, next_kill = 0, start + kill_every_s if kill_every_s else float("inf")
        # Each kill: (when, rank 0's step then, when rank 0 was first past it), for the print-out.
        recoveries: list[list[float]] = []
        while (now := time.monotonic()) < start + seconds:
            _, ranks = node.ranks("bench")
            if recoveries and recoveries[-1][2] == 0 and 0 in ranks and ranks[0].step > recoveries[-1][1]:
                recoveries[-1][2] = now
                print(f"  kill {kills}: step {recoveries[-1][1]:.0f} passed {now - recoveries[-1][0]:.1f}s after it",
                      flush=True)
            if now >= next_kill:
                if 1 in ranks and 0 in ranks:
                    os.kill(ranks[1].pid, signal.SIGKILL)
                    kills += 1
                    recoveries.append([now, float(ranks[0].step), 0.0])
                next_kill += kill_every_s
            time.sleep(0.1)
        last = step_now(node)
        job = node.job("bench")
        return {"steps": float(last - first), "kills": float(kills),
                "restarts": float(job.restart_count if job is not None else -1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every-s", type=float, default=120.0)
    args = p.parse_args()
    with bench_folder("goodput") as root:
        clean = run(args.data, os.path.join(root, "clean"), args.minutes * 60, 0)
        print(f"fault-free: {clean['steps']:.0f} steps in {args.minutes:g} min", flush=True)
        faulty = run(args.data, os.path.join(root, "faulty"), args.minutes * 60, args.kill_every_s)
        print(f"a rank SIGKILLed every {args.kill_every_s:g} s: {faulty['steps']:.0f} steps in {args.minutes:g} min "
              f"({faulty['kills']:.0f} kills, {faulty['restarts']:.0f} restarts)", flush=True)
    goodput = faulty["steps"] / clean["steps"]
    print(f"goodput: {goodput:.3f} (goal >= 0.90)")
    print("BENCH " + json.dumps({"goodput": round(goodput, 4), "clean_steps": clean["steps"],
                                 "faulty_steps": faulty["steps"], "kills": faulty["kills"],
                                 "minutes": args.minutes, "kill_every_s": args.kill_every_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
