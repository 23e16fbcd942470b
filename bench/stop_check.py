"""What a planned stop costs per step, against plain msrun with no stop check at all.

A planned stop names its step: the agent writes it to the stop file, then sends SIGTERM, and
a rank reads it once signalled (nothing per step). A SIGTERM that names no step is agreed
on by the backstop, one allreduce (and a host sync) at every step that is a multiple of
``stop_check_interval_steps``. Each run is the LeNet job under plain ``msrun`` (2 workers, no
daemon; this script plays the agent), timed from the trainer's own heartbeats:

* baseline: no stop check at all (the interval is set past the last step);
* default: the default backstop (every 20 steps) and a named stop, as elasticd makes one:
  at ``--to-step`` the step two ahead of the highest reported is written to the stop file
  and both ranks get SIGTERM;
* backstop k (``--intervals``, default 1 and 20): SIGTERM to rank 1 only, no step named.

For each: milliseconds per step between ``--from-step`` and ``--to-step``, the ratio to the
baseline, and how long until every rank has checkpointed and is leaving with the
planned-exit code (its ``planned_exit`` heartbeat). ``--runs N`` repeats each round and prints
the median.

Usage: python bench/stop_check.py --data build/data/digits [--intervals 1 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from localnode import plain_msrun  # noqa: E402

from mselastic.core import contract  # noqa: E402
from mselastic.core.contract import Beat  # noqa: E402
from mselastic.core.spec import JobSpec  # noqa: E402


DEFAULT = "default"


def run(data: str, work: str, mode: int | str | None, from_step: int, to_step: int) -> dict[str, float]:
    """One plain-msrun run; ``mode`` None: no stop check (the baseline); DEFAULT: a named stop with
    the default backstop; k: the backstop every k steps and a SIGTERM naming no step."""
    total = to_step + 200
    stop_file = os.path.join(work, "stop")
    interval = total + 1 if mode is None else JobSpec.stop_check_interval_steps if mode == DEFAULT else int(mode)
    env = {contract.ENV_TOTAL_STEPS: str(total),
           contract.ENV_CHECKPOINT_INTERVAL: str(total),  # only the stop's checkpoint: the same I/O in every run
           contract.ENV_STOP_CHECK_INTERVAL: str(interval), contract.ENV_STOP_FILE: stop_file}
    at: dict[int, float] = {}
    pids: dict[int, int] = {}
    top = -1  # the highest step any rank reported: what an agent names the stop from
    with plain_msrun(data, work, env) as job:
        while to_step not in at:
            beat = job.beat()
            pids[beat.rank] = beat.pid
            top = max(top, beat.step)
            if beat.kind == "step" and beat.rank == 0:
                at[beat.step] = beat.at
        result = {"step_ms": (at[to_step] - at[from_step]) / (to_step - from_step) * 1000}
        if mode is None:
            return result
        asked = time.time()
        if mode == DEFAULT:
            with open(stop_file, "wb") as f:
                f.write(contract.encode_stop_step(contract.stop_step_ahead([top], 0.0, 0.0)))
            for pid in pids.values():
                os.kill(pid, signal.SIGTERM)
        else:
            os.kill(pids[1], signal.SIGTERM)
        exited: dict[int, Beat] = {}
        while len(exited) < 2:
            beat = job.beat()
            if beat.kind == "planned_exit":
                exited[beat.rank] = beat
        # msrun itself lingers ~30 s after its workers are gone; the agent does not wait for it.
        result["stop_s"] = max(b.at for b in exited.values()) - asked
        result["stop_steps"] = exited[0].step - to_step
        return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 20])
    p.add_argument("--from-step", type=int, default=10, help="timing starts here (after warm-up)")
    p.add_argument("--to-step", type=int, default=75, help="timing ends here; then the SIGTERM")
    p.add_argument("--runs", type=int, default=1)
    a = p.parse_args()
    if min(a.intervals) < 1 or not 0 < a.from_step < a.to_step or a.runs < 1:
        p.error("--intervals >= 1, 0 < --from-step < --to-step and --runs >= 1")
    with tempfile.TemporaryDirectory(prefix="mselastic-bench-") as work:
        results: dict[int | str | None, list[dict[str, float]]] = {k: [] for k in [None, DEFAULT, *a.intervals]}
        for i in range(a.runs):
            for k in results:  # side by side: baseline and each interval in every round
                results[k].append(run(a.data, os.path.join(work, f"r{i}-{k}"), k, a.from_step, a.to_step))

    def median(k: int | str | None, key: str) -> float:
        return statistics.median(r[key] for r in results[k])

    base = median(None, "step_ms")
    print(f"plain msrun, 2 ranks, steps {a.from_step}..{a.to_step}, median of {a.runs}:")
    print(f"  no stop check                        {base:7.1f} ms/step  ratio 1.00")
    for k in [DEFAULT, *a.intervals]:
        what = (f"named step, backstop every {JobSpec.stop_check_interval_steps}" if k == DEFAULT
                else f"backstop every {k}, no step named")
        print(f"  {what:<37}{median(k, 'step_ms'):7.1f} ms/step  ratio {median(k, 'step_ms') / base:.3f}"
              f"   SIGTERM -> every rank checkpointed and leaving: {median(k, 'stop_s'):4.2f} s,"
              f" {median(k, 'stop_steps'):.0f} steps later")
    return 0


if __name__ == "__main__":
    sys.exit(main())
