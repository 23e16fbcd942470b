"""How fast a hung rank is found when the job's spec sets no ``hang_timeout_s`` (#47: the limits
are learned from the job, mselastic.agent.generation.learned), against what the fixed default
found it in (60 s: 30 s for a stopped rank, 60 s for a silent one), in one invocation.

For each run, on this machine, one elasticd (embedded etcd), LeNet on 2 ranks at ``--step-s``
seconds a step (``--step-sleep-s`` of the example: 0.1 s by default), no ``hang_timeout_s``:

1. **stopped**: rank 1 SIGSTOPped once the job is past ``--after`` steps; the time from the
   signal to the agent's verdict (its report's ``detected_at``), and the verdict's reason;
2. **deadlocked**: the next generation's rank 1 blocks for good on a lock in the step
   (``MSELASTIC_FAULT=hang``: asleep, not stopped; rank 0 waits for it in the collective); the
   time from its last step to the verdict.

Also whether any generation was judged hung before the fault (a false verdict): there must be
none. Prints the medians and one ``BENCH {...}`` line.

Usage: make bench-hang   (or: python bench/hang_detection.py --data build/data/digits --runs 3)
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

from localnode import LocalNode, bench_folder, say, wait_for, write_lenet_spec  # noqa: E402

from mselastic.agent.generation import learned  # noqa: E402
from mselastic.core.model import GenerationReport  # noqa: E402
from mselastic.store.keys import Keys  # noqa: E402

KEYS = Keys()
JOB = "hang"


def run_once(data: str, root: str, i: int, step_s: float, after: int) -> dict[str, object]:
    work = os.path.join(root, f"run{i}")
    with LocalNode(work) as node:
        node.start()

        def report(g: int) -> GenerationReport | None:
            raw = node.etcd_get(KEYS.report(JOB, g, node.node_id))
            return GenerationReport.from_json(raw) if raw else None

        path = write_lenet_spec(os.path.join(work, "job.toml"), JOB, data, os.path.join(work, "out"),
                                os.path.join(work, "ckpt"), 100000, max_restarts=5, quarantine_after_failures=10,
                                args=("--step-sleep-s", str(step_s)), checkpoint_interval_steps=20,
                                more=f'snapshot_interval_steps = 0\nenv = {{ MSELASTIC_FAULT = '
                                     f'"hang:rank=1:generation=2:step={after + 45}" }}\n')
        done = node.elasticctl("submit", path)
        if done.returncode != 0:
            raise SystemExit(done.stderr)
        wait_for(f"step {after}", lambda: (r := report(1)) and (r.state.terminal or r.step >= after), 300, 0.1)
        gen, ranks = node.ranks(JOB)
        if gen != 1 or 1 not in ranks:
            raise SystemExit(f"generation 1's rank 1 not found (generation {gen}): judged hung before the fault?")
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped_at = time.time()
        first = wait_for("generation 1's verdict", lambda: (r := report(1)) and r.state.terminal and r, 120, 0.05)
        second = wait_for("generation 2's verdict", lambda: (r := report(2)) and r.state.terminal and r, 300, 0.1)
        out = {"stopped_s": first.detected_at - stopped_at, "stopped_reason": first.reason,
               "deadlock_reason": second.reason}
        # Its last beat: the report's step at the verdict is rank 0's; rank 1 stopped a step short.
        out["deadlock_s"] = float(second.reason.split("no heartbeat for ", 1)[1].split("s", 1)[0]) \
            if "no heartbeat for " in second.reason else float("nan")
        say(f"run {i}: stopped rank found in {out['stopped_s']:.2f}s ({first.reason}); deadlocked in "
            f"{out['deadlock_s']:.1f}s ({second.reason})")
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--step-s", type=float, default=0.1, help="the example's --step-sleep-s")
    p.add_argument("--after", type=int, default=40, help="steps before rank 1 is SIGSTOPped")
    args = p.parse_args()
    results = []
    with bench_folder("hang") as root:
        for i in range(args.runs):
            results.append(run_once(args.data, root, i, args.step_s, args.after))
    stopped = statistics.median(float(r["stopped_s"]) for r in results)  # type: ignore[arg-type]
    deadlock = statistics.median(float(r["deadlock_s"]) for r in results)  # type: ignore[arg-type]
    fixed_stopped, fixed_silent = learned.FALLBACK_S / 2, learned.FALLBACK_S
    print(f"stopped (SIGSTOP) rank found: median {stopped:.2f}s, against {fixed_stopped:.0f}s with the fixed default "
          f"(x{stopped / fixed_stopped:.3f})")
    print(f"deadlocked rank found:        median {deadlock:.1f}s, against {fixed_silent:.0f}s with the fixed default "
          f"(x{deadlock / fixed_silent:.3f})")
    print("BENCH " + json.dumps({"stopped_s": round(stopped, 2), "deadlock_s": round(deadlock, 1),
                                 "runs": args.runs, "step_sleep_s": args.step_s}))


if __name__ == "__main__":
    main()
