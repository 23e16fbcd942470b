"""elasticctl: the admin CLI. Talks gRPC to an elasticd's Control service.

Examples::

    elasticctl status                      # every job, the nodes and the leader
    elasticctl status lenet -o json        # one job, machine-readable
    elasticctl submit examples/lenet/job.toml
    elasticctl stop lenet --grace-period-s 30
    elasticctl drain node-b                # move running jobs off node-b, nothing lost
    elasticctl uncordon node-b             # node-b may run generations again

Any elasticd may be named by --endpoint: changes are forwarded to the leader,
and right after a cluster starts they wait (up to --timeout-s) for one to be elected.

Exit codes: 0 done; 1 refused by the cluster (unknown job, job exists, ...);
2 bad arguments or a bad spec (nothing was sent); 3 no elasticd (or no leader) reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import grpc
import tenacity
from google.protobuf import json_format

from mselastic.core.spec import SpecError, load_toml
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
NOT_LEADER_PREFIX = "not the leader; leader is "  # the Control service's refusal text


class CtlError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _NoLeaderYet(Exception):
    pass


def _call(endpoint: str, method: Callable[[pb_grpc.ControlStub], Any], timeout_s: float) -> Any:
    """Call the Control service; while no leader is elected yet (a cluster just started), retry."""
    try:
        return tenacity.Retrying(stop=tenacity.stop_after_delay(timeout_s), wait=tenacity.wait_fixed(0.5),
                                 retry=tenacity.retry_if_exception_type(_NoLeaderYet), reraise=True)(
            _call_once, endpoint, method, timeout_s)
    except _NoLeaderYet:
        raise CtlError(f"no leader elected after {timeout_s:.0f}s; is etcd reachable from the daemons?",
                       EXIT_UNREACHABLE) from None


def _call_once(endpoint: str, method: Callable[[pb_grpc.ControlStub], Any], timeout_s: float) -> Any:
    """One call, following one not-the-leader redirect."""
    for _ in range(2):
        with grpc.insecure_channel(endpoint) as ch:
            try:
                return method(pb_grpc.ControlStub(ch))(timeout=timeout_s)
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(NOT_LEADER_PREFIX):
                    nxt = details[len(NOT_LEADER_PREFIX):]
                    if ":" not in nxt:
                        raise _NoLeaderYet()
                    if ":" in nxt and nxt != endpoint:
                        endpoint = nxt
                        continue
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise CtlError(f"cannot reach elasticd at {endpoint}: {details}; "
                                   "check --endpoint or $ELASTICCTL_ENDPOINT", EXIT_UNREACHABLE) from None
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise CtlError(details, EXIT_USAGE) from None
                raise CtlError(details, EXIT_REFUSED) from None
    raise CtlError("no leader answered; retry in a few seconds", EXIT_UNREACHABLE)


def _state(v: int) -> str:
    return pb.JobState.Name(v).removeprefix("JOB_STATE_")


def _ago(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def print_status(res: pb.StatusResponse, out: Any) -> None:
    print(f"LEADER  {res.leader or '(none)'}", file=out)
    def node(n: pb.NodeInfo) -> str:
        return f"{n.node_id}({n.slots}{', draining' if n.draining else ', cordoned' if n.cordoned else ''})"

    print(f"NODES   {', '.join(node(n) for n in res.nodes) or '(none)'}", file=out)
    if not res.jobs:
        print("JOBS    (none)", file=out)
        return
    print(f"{'JOB':<16}{'STATE':<12}{'GEN':>4}{'WORLD':>6}{'RESTARTS':>9}{'STEP':>12}  NODES", file=out)
    for j in res.jobs:
        step = f"{max(j.step, 0)}/{j.total_steps}"
        nodes = ",".join(m.node_id for m in j.members) or "-"
        print(f"{j.job:<16}{_state(j.state):<12}{j.generation:>4}{j.world_size:>6}{j.restart_count:>9}{step:>12}  {nodes}",
              file=out)
        if j.message:
            print(f"  message: {j.message}", file=out)
        if j.note:
            print(f"  note: {j.note}", file=out)
        for q in j.quarantined:
            print(f"  quarantined: {q.node_id} ({q.failures} failures), {max(0.0, q.until - time.time()):.0f}s "
                  "of cooldown left", file=out)
        if j.HasField("last_failure"):
            f = j.last_failure
            rec = f"{f.recover_s:.2f}s" if f.recover_s else "pending"
            who = f"rank {f.rank} on {f.node_id}" if f.rank >= 0 else f.node_id
            print(f"  last failure: generation {f.generation}, {who}: {f.reason}; detected {_ago(f.detected_at)}, "
                  f"recovered in {rec}", file=out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elasticctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default=os.environ.get("ELASTICCTL_ENDPOINT", "127.0.0.1:7070"),
                   help="any elasticd's host:port (env ELASTICCTL_ENDPOINT; default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="per-call deadline (default %(default)s)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("status", help="jobs, nodes and the leader", description="Example: elasticctl status lenet")
    s.add_argument("job", nargs="?", default="")
    s.add_argument("-o", "--output", choices=["table", "json"], default="table")
    s = sub.add_parser("submit", help="submit a job spec (TOML)",
                       description="Example: elasticctl submit job.toml. The spec is validated before sending.")
    s.add_argument("spec")
    s = sub.add_parser("stop", help="stop a job (workers checkpoint, then exit)",
                       description="Example: elasticctl stop lenet --grace-period-s 30")
    s.add_argument("job")
    s.add_argument("--grace-period-s", type=float, default=0.0, help="0: the job spec's stop_grace_period_s")
    s = sub.add_parser("cordon", help="no new generations on a node (running ones go on)",
                       description="Example: elasticctl cordon node-b --reason 'disk replacement'")
    s.add_argument("node")
    s.add_argument("--reason", default="")
    s = sub.add_parser("drain", help="cordon a node and move its running jobs off it (planned, nothing lost)",
                       description="Example: elasticctl drain node-b. Each job on the node is relaunched without it: "
                                   "its ranks checkpoint at the next step and the next generation resumes there. "
                                   "Waits until no job runs on the node (--wait-s; 0: do not wait).")
    s.add_argument("node")
    s.add_argument("--reason", default="")
    s.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the drain (default %(default)s)")
    s = sub.add_parser("uncordon", help="let a node run generations again (a running job may scale up to it)",
                       description="Example: elasticctl uncordon node-b")
    s.add_argument("node")
    return p


def _cordon(args: argparse.Namespace, cordon: bool, drain: bool) -> None:
    req = pb.CordonRequest(node_id=args.node, cordon=cordon, drain=drain, reason=getattr(args, "reason", ""))
    _call(args.endpoint, lambda c: lambda **kw: c.Cordon(req, **kw), args.timeout_s)


def _wait_drained(args: argparse.Namespace, out: Any) -> None:
    """Until no unfinished job has the node in its current generation, and nothing runs there."""
    def jobs_on_node() -> list[pb.JobStatus]:
        res = _call(args.endpoint, lambda c: lambda **kw: c.Status(pb.StatusRequest(), **kw), args.timeout_s)
        running = {j for n in res.nodes if n.node_id == args.node for j in n.running_jobs}
        return [j for j in res.jobs if j.job in running or (_state(j.state) in ("PENDING", "RUNNING", "RESTARTING")
                                                            and any(m.node_id == args.node for m in j.members))]

    try:
        tenacity.Retrying(stop=tenacity.stop_after_delay(args.wait_s), wait=tenacity.wait_fixed(1.0),
                          retry=tenacity.retry_if_result(bool))(jobs_on_node)
    except tenacity.RetryError as e:
        left = e.last_attempt.result()
        why = "; ".join(f"{j.job}: {j.note or j.message}" for j in left)
        raise CtlError(f"node {args.node} still runs {', '.join(j.job for j in left)} after {args.wait_s:.0f}s "
                       f"({why}); it stays cordoned and draining", EXIT_REFUSED) from None


def run(argv: list[str] | None, out: Any = sys.stdout) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "status":
        res = _call(args.endpoint, lambda c: lambda **kw: c.Status(pb.StatusRequest(job=args.job), **kw), args.timeout_s)
        if args.output == "json":
            print(json.dumps(json_format.MessageToDict(res, preserving_proto_field_name=True), indent=2), file=out)
        else:
            print_status(res, out)
    elif args.command == "submit":
        try:
            spec = load_toml(args.spec)
        except SpecError as e:
            raise CtlError(f"{args.spec}: {e}", EXIT_USAGE) from None
        res = _call(args.endpoint, lambda c: lambda **kw: c.Submit(pb.SubmitRequest(spec_json=spec.to_json()), **kw),
                    args.timeout_s)
        print(f"job {res.job} submitted", file=out)
    elif args.command == "stop":
        if args.grace_period_s < 0:
            raise CtlError("--grace-period-s must be >= 0", EXIT_USAGE)
        res = _call(args.endpoint, lambda c: lambda **kw: c.StopJob(
            pb.StopJobRequest(job=args.job, grace_period_s=args.grace_period_s), **kw), args.timeout_s + 60)
        print(f"job {args.job} {_state(res.state)}", file=out)
    elif args.command in ("cordon", "drain", "uncordon"):
        _cordon(args, cordon=args.command != "uncordon", drain=args.command == "drain")
        if args.command == "drain" and args.wait_s > 0:
            _wait_drained(args, out)
        print(f"node {args.node} {args.command}ed", file=out)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except CtlError as e:
        print(f"elasticctl: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
