"""Recovery from a killed rank, against a plain-msrun cold start, side by side.

1. Baseline: the LeNet job under plain ``msrun`` (2 workers, no daemon): launch ->
   first training step (the trainer's heartbeats are received by this script).
2. Elastic: the same job under elasticd; rank 1 is SIGKILLed mid-training and the
   phases of the recovery are read from the agent's reports and the job's events:
   detect (kill -> agent noticed), teardown (-> every process gone), plan
   (-> next generation committed), relaunch (-> first step), total (kill -> first step).

Prints each phase and the ratio total recovery / cold start (goal: detect <= 1 s,
ratio <= 1.5). ``--runs N`` repeats both and prints the median.

Usage: make bench   (or: python bench/recovery.py --data build/data/digits --runs 3)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from localnode import REPO, LocalNode, plain_msrun, wait_for, write_lenet_spec  # noqa: E402

from mselastic.core import contract  # noqa: E402
from mselastic.core.model import Event, GenerationReport  # noqa: E402
from mselastic.store.keys import Keys  # noqa: E402
from mselastic.core.states import GenerationState  # noqa: E402

KEYS = Keys()  # the default namespace the bench's elasticd uses


def plain_msrun_cold_start(data: str, work: str) -> float:
    """Seconds from starting msrun to the first training step, with no daemon involved."""
    with plain_msrun(data, work, {contract.ENV_TOTAL_STEPS: "20"}) as run:
        while (beat := run.beat()).kind != "step":
            pass
        return beat.at - run.started


def elastic_recovery(data: str, work: str, kill_at_step: int) -> dict[str, float]:
    node = LocalNode(work).start()
    try:
        spec = write_lenet_spec(os.path.join(work, "job.toml"), "bench", data, os.path.join(work, "out"),
                                os.path.join(work, "ckpt"), kill_at_step + 60)
        assert node.elasticctl("submit", spec).returncode == 0
        wait_for("training", lambda: (j := node.job("bench")) and j.step >= kill_at_step, 180, 0.1)
        _, ranks = node.ranks("bench")
        os.kill(ranks[1].pid, signal.SIGKILL)
        killed = time.time()

        def report(g: int) -> GenerationReport | None:
            raw = node.etcd_get(KEYS.report("bench", g, node.node_id))
            return GenerationReport.from_json(raw) if raw else None

        failed = wait_for("failure report", lambda: (r := report(1)) and r.state is GenerationState.FAILED and r, 10)
        second = wait_for("first step of generation 2", lambda: (r := report(2)) and r.first_step_at and r, 120, 0.1)
        events = [Event.from_json(v) for v in node.etcd_values(KEYS.events("bench"))]
        committed = next(e.at for e in events if e.kind == "generation" and e.generation == 2)
        return {"detect_s": failed.detected_at - killed, "teardown_s": failed.stopped_at - failed.detected_at,
                "plan_s": committed - failed.stopped_at, "relaunch_to_first_step_s": second.first_step_at - committed,
                "recovery_s": second.first_step_at - killed,
                "steps_recomputed": float(failed.step - second.resumed_step)}
    finally:
        left = node.stop()
        if left:
            print(f"warning: killed leftover processes {left}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(REPO, "build", "data", "digits"))
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--kill-at-step", type=int, default=35)
    p.add_argument("--work", default=os.path.join(REPO, "build", "bench"))
    args = p.parse_args()
    colds, recs = [], []
    for i in range(args.runs):
        cold = plain_msrun_cold_start(os.path.abspath(args.data), os.path.join(args.work, f"plain-{i}"))
        print(f"run {i + 1}: plain msrun cold start -> first step: {cold:.2f}s", flush=True)
        rec = elastic_recovery(os.path.abspath(args.data), os.path.join(args.work, f"elastic-{i}"), args.kill_at_step)
        print(f"run {i + 1}: elasticd rank kill: " + ", ".join(f"{k}={v:.2f}" for k, v in rec.items()), flush=True)
        colds.append(cold)
        recs.append(rec)
    med = {k: statistics.median(r[k] for r in recs) for k in recs[0]}
    cold = statistics.median(colds)
    print(f"\n{'phase':<28}{'median s':>10}   (runs={args.runs})")
    print(f"{'plain msrun cold start':<28}{cold:>10.2f}")
    for k in ("detect_s", "teardown_s", "plan_s", "relaunch_to_first_step_s", "recovery_s"):
        print(f"{k:<28}{med[k]:>10.2f}")
    ratio = med["recovery_s"] / cold
    print(f"{'ratio recovery/cold start':<28}{ratio:>10.2f}   goal <= 1.5")
    print("BENCH " + json.dumps({"cold_start_s": round(cold, 3), **{k: round(v, 3) for k, v in med.items()},
                                 "ratio": round(ratio, 3), "runs": args.runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
