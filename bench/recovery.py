"""Recovery from a killed rank, side by side in one invocation, against plain msrun and torchrun.

For each run, on this machine, 2 ranks, LeNet on the digits data set:

1. plain msrun (no daemon): launch -> first training step (the cold start every relaunch would
   pay without mselastic; the trainer's heartbeats are received by this script);
2. mselastic cold: elasticd with ``--warm-standbys false``; rank 1 SIGKILLed mid-training; the
   phases of the recovery read from the agent's reports and the job's events: detect (kill ->
   agent noticed), teardown (-> every process gone), plan (-> next generation committed), relaunch
   (-> first step), recovery (kill -> first step);
3. mselastic warm (the default): the same, once the agent's standby workers are ready; also what
   the standbys cost while idle (memory, CPU) and elasticd's own while the job trains;
4. torchrun (PyTorch's elastic agent, c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
   gloo, the same LeNet: ``bench/torch_lenet.py``) in the bench's own environment: launch -> first
   step, and rank 1 SIGKILLed -> first step of the restart. Skipped without ``--torch-python``.

Prints the medians with ratios, then one ``BENCH {...}`` line: ``recovery_s`` is the default
(warm) path, ``cold_start_s`` plain msrun's.

Usage: make bench   (or: python bench/recovery.py --data build/data/digits --runs 3 --torch-python PY)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Iterator

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from localnode import REPO, LocalNode, plain_msrun, wait_for, write_lenet_spec  # noqa: E402

from mselastic.core import contract  # noqa: E402
from mselastic.core.model import Event, GenerationReport  # noqa: E402
from mselastic.store.embedded import free_port  # noqa: E402
from mselastic.store.keys import Keys  # noqa: E402
from mselastic.core.states import GenerationState  # noqa: E402

KEYS = Keys()  # the default namespace the bench's elasticd uses
TORCH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_lenet.py")


def plain_msrun_cold_start(data: str, work: str) -> float:
    """Seconds from starting msrun to the first training step, with no daemon involved."""
    with plain_msrun(data, work, {contract.ENV_TOTAL_STEPS: "20"}) as run:
        while (beat := run.beat()).kind != "step":
            pass
        return beat.at - run.started


def _cost(pids: list[int], seconds: float = 3.0, unique: bool = False) -> tuple[float, float]:
    """(MiB resident, % of one core) of these processes together, over ``seconds``. ``unique``: the
    memory only they hold (USS: what their exit would free), not what they share copy-on-write
    with the process they were forked from."""
    ps = [psutil.Process(pid) for pid in pids]
    for p in ps:
        p.cpu_percent(None)
    time.sleep(seconds)
    mem = sum(p.memory_full_info().uss if unique else p.memory_info().rss for p in ps)
    return (mem / 2 ** 20, sum(p.cpu_percent(None) for p in ps))


def elastic_recovery(data: str, work: str, kill_at_step: int, warm: bool) -> dict[str, float]:
    with LocalNode(work).start(*([] if warm else ["--warm-standbys", "false"])) as node:
        spec = write_lenet_spec(os.path.join(work, "job.toml"), "bench", data, os.path.join(work, "out"),
                                os.path.join(work, "ckpt"), kill_at_step + 200)
        assert node.elasticctl("submit", spec).returncode == 0
        wait_for("training", lambda: (j := node.job("bench")) and j.step >= kill_at_step, 180, 0.1)
        cost: dict[str, float] = {}
        if warm:
            ready = wait_for("3 standbys", lambda: len(s := [x for x in node.standbys("bench") if x.ready]) == 3 and s,
                             120, 0.2)
            assert node.daemon is not None
            cost["elasticd_rss_mib"], cost["elasticd_cpu_pct"] = _cost([node.daemon.pid])
            # The standbys are forked from one server per job and node: its memory once, then what
            # each standby holds of its own.
            cost["standby_server_rss_mib"], _ = _cost(list({psutil.Process(s.pid).ppid() for s in ready}), 0.1)
            cost["standby_uss_mib"], cost["standby_cpu_pct"] = _cost([s.pid for s in ready], unique=True)
            cost["standby_uss_mib"] /= len(ready)
        _, ranks = node.ranks("bench")
        os.kill(ranks[1].pid, signal.SIGKILL)
        killed = time.time()

        def report(g: int) -> GenerationReport | None:
            raw = node.etcd_get(KEYS.report("bench", g, node.node_id))
            return GenerationReport.from_json(raw) if raw else None

        failed = wait_for("failure report", lambda: (r := report(1)) and r.state is GenerationState.FAILED and r, 10)
        second = wait_for("first step of generation 2", lambda: (r := report(2)) and r.first_step_at and r, 120, 0.1)
        assert second.warm is warm, f"generation 2 started {'warm' if second.warm else 'cold'}"
        events = [Event.from_json(v) for v in node.etcd_values(KEYS.events("bench"))]
        committed = next(e.at for e in events if e.kind == "generation" and e.generation == 2)
        return {"detect_s": failed.detected_at - killed, "teardown_s": failed.stopped_at - failed.detected_at,
                "plan_s": committed - failed.stopped_at, "relaunch_to_first_step_s": second.first_step_at - committed,
                "recovery_s": second.first_step_at - killed,
                "steps_recomputed": float(failed.step - second.resumed_step), **cost}


@contextlib.contextmanager
def _beats(name: str) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(120)
    try:
        yield sock
    finally:
        sock.close()


def torchrun_recovery(python: str, data: str, work: str, kill_at_step: int) -> dict[str, float]:
    """torchrun's cold start and its restart after rank 1 is SIGKILLed (seconds)."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "ckpt"))
    name = f"mselastic-bench-torch-{os.getpid()}-{time.time_ns()}"
    env = dict(os.environ, BENCH_BEAT=name, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
               PATH=os.path.dirname(python) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [os.path.join(os.path.dirname(python), "torchrun"), "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", TORCH_SCRIPT, data,
           os.path.join(work, "ckpt"), str(kill_at_step + 200)]
    with _beats(name) as sock, open(os.path.join(work, "torchrun.log"), "wb") as log:
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            first = 0.0
            while True:
                beat = json.loads(sock.recv(4096))
                first = first or beat["at"]
                if beat["step"] >= kill_at_step and beat["rank"] == 1:
                    break
            os.kill(beat["pid"], signal.SIGKILL)
            killed = time.time()
            while (beat := json.loads(sock.recv(4096)))["restart"] < 1:
                pass
            return {"cold_start_s": first - started, "recovery_s": beat["at"] - killed}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(REPO, "build", "data", "digits"))
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--kill-at-step", type=int, default=35)
    p.add_argument("--work", default=os.path.join(REPO, "build", "bench"))
    p.add_argument("--torch-python", default="", help="the bench environment's Python, with torch (make bench makes it)")
    args = p.parse_args()
    data = os.path.abspath(args.data)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "cold": [], "warm": [], "torch": []}
    for i in range(args.runs):
        cold_start = plain_msrun_cold_start(data, os.path.join(args.work, f"plain-{i}"))
        runs["plain"].append({"cold_start_s": cold_start})
        print(f"run {i + 1}: plain msrun cold start -> first step: {cold_start:.2f}s", flush=True)
        for kind in ("cold", "warm"):
            rec = elastic_recovery(data, os.path.join(args.work, f"{kind}-{i}"), args.kill_at_step, kind == "warm")
            runs[kind].append(rec)
            print(f"run {i + 1}: mselastic {kind}, rank kill: " + ", ".join(f"{k}={v:.2f}" for k, v in rec.items()),
                  flush=True)
        if args.torch_python:
            rec = torchrun_recovery(args.torch_python, data, os.path.join(args.work, f"torch-{i}"), args.kill_at_step)
            runs["torch"].append(rec)
            print(f"run {i + 1}: torchrun: " + ", ".join(f"{k}={v:.2f}" for k, v in rec.items()), flush=True)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind]) if runs[kind] else float("nan")

    cold_start, cold, warm, torch = med("plain", "cold_start_s"), med("cold", "recovery_s"), med("warm", "recovery_s"), \
        med("torch", "recovery_s")
    print(f"\nmedians of {args.runs} run(s), seconds")
    print(f"{'':34}{'plain msrun':>13}{'mselastic cold':>16}{'mselastic warm':>16}{'torchrun':>10}")
    print(f"{'launch -> first step':34}{cold_start:>13.2f}{'':>16}{'':>16}{med('torch', 'cold_start_s'):>10.2f}")
    for key in ("detect_s", "teardown_s", "plan_s", "relaunch_to_first_step_s", "recovery_s"):
        label = "rank SIGKILL -> first new step" if key == "recovery_s" else key
        print(f"{label:34}{'':>13}{med('cold', key):>16.2f}{med('warm', key):>16.2f}"
              f"{torch if key == 'recovery_s' else float('nan'):>10.2f}")
    print(f"{'steps recomputed':34}{'':>13}{med('cold', 'steps_recomputed'):>16.0f}{med('warm', 'steps_recomputed'):>16.0f}")
    print(f"\nwarm recovery / torchrun's: {warm / torch:.2f} (milestone <= 1.5, goal <= 1.0); "
          f"/ plain msrun cold start: {warm / cold_start:.2f} (goal <= 0.35); cold recovery / warm: {cold / warm:.2f}")
    print(f"3 idle standbys: their fork server {med('warm', 'standby_server_rss_mib'):.0f} MiB resident, each "
          f"standby {med('warm', 'standby_uss_mib'):.0f} MiB of its own, "
          f"{med('warm', 'standby_cpu_pct'):.1f} % of a core together; elasticd while training: "
          f"{med('warm', 'elasticd_rss_mib'):.0f} MiB, {med('warm', 'elasticd_cpu_pct'):.1f} % of a core")
    bench = {"cold_start_s": cold_start, "recovery_s": warm, "cold_recovery_s": cold, "torchrun_recovery_s": torch,
             "torchrun_cold_start_s": med("torch", "cold_start_s"), "detect_s": med("warm", "detect_s"),
             "steps_recomputed": med("warm", "steps_recomputed"), "ratio_torchrun": warm / torch,
             "ratio": warm / cold_start, "standby_server_rss_mib": med("warm", "standby_server_rss_mib"),
             "standby_uss_mib": med("warm", "standby_uss_mib"),
             "standby_cpu_pct": med("warm", "standby_cpu_pct"), "elasticd_rss_mib": med("warm", "elasticd_rss_mib"),
             "elasticd_cpu_pct": med("warm", "elasticd_cpu_pct"), "runs": args.runs}
    print("BENCH " + json.dumps({k: (None if v != v else round(v, 3)) if isinstance(v, float) else v
                                 for k, v in bench.items()}))  # (NaN: not measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
