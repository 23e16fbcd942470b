"""`make demo`: an elastic data-parallel MindSpore job on this machine, a rank killed
on purpose, and the recovery shown.

Starts one elasticd (agent + coordinator) with an embedded single-member etcd on
loopback, submits the LeNet job (2 local workers) with elasticctl, SIGKILLs rank 1
mid-training, follows the job through detection, teardown, the new generation and
the resume from the last snapshot or checkpoint, and ends with one summary line::

    RESULT generations=2 detect_s=0.09 recover_s=4.0 relaunch=warm steps_recomputed=0 final_step=300 loss=0.00 accuracy=0.97

Everything it started is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from localnode import REPO, LocalNode, say, wait_for, write_lenet_spec

from mselastic.core.model import GenerationReport, JobStatus, Plan
from mselastic.core.states import GenerationState
from mselastic.store import versions
from mselastic.store.embedded import etcd_binary, etcd_version
from mselastic.store.keys import Keys
from mselastic.v1 import elastic_pb2 as pb

JOB = "lenet"
KEYS = Keys()  # the default namespace the demo's elasticd uses
TERMINAL = {pb.JobState.Value(n) for n in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_STOPPED")}


def follow(node: LocalNode, until: int, every: int) -> pb.JobStatus:
    """Print progress until the job reaches step ``until`` or ends."""
    last = -every
    while True:
        job = wait_for("the job's status", lambda: node.job(JOB), 30)
        if job.step >= until or job.state in TERMINAL:
            return job
        if job.step >= last + every:
            say(f"generation {job.generation}: step {job.step}/{job.total_steps}")
            last = job.step
        time.sleep(0.2)


def report(node: LocalNode, generation: int) -> GenerationReport | None:
    raw = node.etcd_get(KEYS.report(JOB, generation, node.node_id))
    return GenerationReport.from_json(raw) if raw else None


def run(node: LocalNode, args: argparse.Namespace) -> int:
    out_dir = os.path.join(args.work, "out")
    spec = write_lenet_spec(os.path.join(args.work, "job.toml"), JOB, args.data, out_dir,
                            os.path.join(args.work, "ckpt"), args.steps)
    submitted = node.elasticctl("submit", spec)
    if submitted.returncode != 0:
        raise SystemExit(submitted.stderr.strip())
    say(submitted.stdout.strip())
    follow(node, args.kill_at_step, 25)

    generation, ranks = node.ranks(JOB)
    victim = ranks[1]
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.time()
    say(f"SIGKILL rank 1 (pid {victim.pid}) of generation {generation} at step {victim.step}")
    failed = wait_for("the agent's report", lambda: (r := report(node, generation))
                      and r.state is GenerationState.FAILED and r, 10)
    detect_s = failed.detected_at - killed_at
    say(f"agent detected it after {detect_s:.2f}s ({failed.reason}); every process of generation {generation} "
        f"gone {failed.stopped_at - failed.detected_at:.2f}s later, at step {failed.step}")
    plan = wait_for("the next generation", lambda: (raw := node.etcd_get(KEYS.plan(JOB)))
                    and (p := Plan.from_json(raw)).generation > generation and p, 30)
    say(f"coordinator committed generation {plan.generation} (master port {plan.master_port}, "
        f"restart {plan.restart_count})")
    resumed = wait_for("the first step of the new generation",
                       lambda: (r := report(node, plan.generation)) and r.first_step_at and r, 180, 0.2)
    how = "warm: standby workers with MindSpore imported took over" if resumed.warm else "cold: msrun started anew"
    kept = "the checkpoint" if resumed.resumed_step % 10 == 0 else "the snapshot (in the node's memory)"
    say(f"generation {plan.generation} resumed from {kept} of step {resumed.resumed_step} ({how}); first "
        f"step {resumed.first_step_at - failed.detected_at:.1f}s after detection")

    job = follow(node, args.steps + 1, 50)
    print(node.elasticctl("status").stdout, end="", flush=True)
    if job.state != pb.JobState.Value("JOB_STATE_SUCCEEDED"):
        say(f"job ended {pb.JobState.Name(job.state)}: {job.message}")
        return 1
    status = JobStatus.from_json(node.etcd_get(KEYS.status(JOB)) or b"")
    with open(os.path.join(out_dir, f"result_g{job.generation}.json")) as f:
        result = json.load(f)
    recover_s = status.last_failure.recover_s if status.last_failure else 0.0
    print(f"RESULT generations={job.generation} detect_s={detect_s:.2f} recover_s={recover_s:.1f} "
          f"relaunch={'warm' if resumed.warm else 'cold'} "
          f"steps_recomputed={failed.step - resumed.resumed_step} final_step={result['final_step']} "
          f"loss={result['loss']:.2f} accuracy={result['accuracy']:.2f}", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(REPO, "build", "data", "digits"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at-step", type=int, default=125)
    p.add_argument("--work", default=os.path.join(REPO, "build", "demo"))
    args = p.parse_args()
    node = LocalNode(args.work)
    version = etcd_version()
    say(f"starting elasticd (embedded etcd {version} from {etcd_binary()} on {node.etcd_endpoint}, gRPC on "
        f"{node.endpoint}); logs under {args.work}")
    if not versions.supported(version):
        say(f"WARNING: etcd {version} is below the versions etcd's maintainers support ({versions.POLICY}): "
            f"fine for this demo, not for a cluster (as root on Debian/Ubuntu, make installs etcd-server)")
    try:
        node.start()
        return run(node, args)
    except KeyboardInterrupt:
        say("interrupted: stopping everything")
        return 130
    finally:
        left = node.stop()
        say("elasticd stopped; nothing left running" if not left else f"killed leftover processes {left}")


if __name__ == "__main__":
    sys.exit(main())
