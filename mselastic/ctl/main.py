"""elasticctl: the admin CLI of an mselastic cluster. Talks gRPC to any elasticd.

Examples::

    elasticctl status                          # the leader, the nodes, every job
    elasticctl nodes                           # nodes: slots, cordoned/draining, jobs on them
    elasticctl jobs -o yaml                    # every job, machine-readable
    elasticctl describe job lenet              # spec, members, generations, recent events
    elasticctl events lenet                    # the timeline: generations, faults, detection and recovery
    elasticctl logs lenet --rank 1 -f          # a rank's log from the node that runs it (--all: MindSpore's chatter too)
    elasticctl submit examples/lenet/job.toml  # validated here first: a bad field is named, nothing sent
    elasticctl stop lenet                      # ranks checkpoint a few steps ahead, then exit
    elasticctl restart lenet                   # checkpoint a few steps ahead, relaunch, resume there
    elasticctl delete lenet                    # forget a finished job (checkpoints stay): the name is free
    elasticctl scale lenet --min 1 --max 4     # change the node range (world sizes must stay valid)
    elasticctl drain n1                        # move jobs off n1, nothing lost; waits until done
    elasticctl cordon n1 / uncordon n1         # no new generations on n1 / back in service
    elasticctl remove-node n1                  # n1 gone for good (its elasticd stopped): forget its records
    elasticctl watch lenet                     # live: step, samples/s, loss, generation, world size
    elasticctl report lenet -o timeline.png    # picture of the run: step over time, faults, world size

Connection (named like etcdctl's): --endpoints a:7070,b:7070 (any elasticd; the first that
answers is used and changes are forwarded to the leader), --cacert/--cert/--key for TLS;
environment: ELASTICCTL_ENDPOINTS, ELASTICCTL_CACERT, ELASTICCTL_CERT, ELASTICCTL_KEY.
Default: the local elasticd's socket (unix:/run/mselastic/elasticd.sock: root and its group
may open it; an elasticd of your own: $XDG_RUNTIME_DIR/mselastic/elasticd.sock or
~/.mselastic/elasticd.sock), else 127.0.0.1:7070, where without a certificate one may only look.

Exit codes: 0 done; 1 refused by the cluster (unknown job or node, job exists, wrong state,
a role the caller does not have), or, for watch, the job ended other than SUCCEEDED; 2 bad
arguments or a bad spec (nothing was sent); 3 no elasticd (or no elected leader) reachable;
4 the endpoint answers but is not an elasticd (etcd's port, an HTTP server); 5 elasticd
answered but cannot reach etcd.
"""

from __future__ import annotations

import argparse
import time
import os
import re
import sys
from typing import Any, Callable, NoReturn

import grpc
import tenacity

from mselastic.wire import plan_from_pb
from mselastic.core import retries
from mselastic.core.contract import default_sockets
from mselastic.core.kinds import EventKind
from mselastic.core.spec import INT32_MAX, MAX_INTS, MAX_SECONDS, SpecError, load_toml
from mselastic import __version__, systemd
from mselastic.ctl import render
from mselastic.ctl.render import LogLines
from mselastic.tls import CA_DAYS, CERT_DAYS, ROLES, TlsError, TlsFiles, describe, issue, make_ca, revoke
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NOT_ELASTICD, EXIT_ETCD_DOWN = 0, 1, 2, 3, 4, 5
#: Where elasticctl asks when no endpoint is given and no local socket may be opened.
FALLBACK = "127.0.0.1:7070"
#: How long ``nodes --wait`` waits for a node to register.
NODE_WAIT_S = 60.0
#: The states ``watch --until`` waits for.
WATCHABLE = tuple(n.removeprefix("JOB_STATE_") for n in pb.JobState.keys() if not n.endswith("UNSPECIFIED"))
ETCD_UNAVAILABLE_PREFIX = "etcd unavailable"  # the Control service's answer when it cannot read etcd
NOT_LEADER_PREFIX = "not the leader; leader is "  # the Control service's refusal text


class CtlError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _NoLeaderYet(Exception):
    pass


def _socket_within(timeout_s: float) -> str | None:
    """The first default socket this user may open, waiting up to ``timeout_s`` for one."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = next(("unix:" + p for p in default_sockets() if os.access(p, os.R_OK | os.W_OK)), None)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def local_only(address: str, via: str, what: str) -> None:
    """A ``unix:`` address (the nodes of a cluster on one machine register their sockets) names a
    socket on that machine: followed only by an elasticctl that came through a socket itself."""
    if address.startswith("unix:") and not via.startswith("unix:"):
        raise CtlError(f"{what} is reached through its socket ({address}) on its own machine: run elasticctl "
                       f"there", EXIT_REFUSED)


class Client:
    """Calls to the Control service of the first elasticd that answers, following leader redirects."""

    def __init__(self, endpoints: list[str], tls: TlsFiles, timeout_s: float) -> None:
        self.endpoints = endpoints
        self.tls = tls
        self.timeout_s = timeout_s

    def call(self, method: Callable[[pb_grpc.ControlStub], Any], timeout_s: float | None = None) -> Any:
        """``method(stub)`` returns the bound RPC; while no leader is elected yet, retry."""
        timeout = timeout_s or self.timeout_s
        try:
            return retries.until_no_error(_NoLeaderYet, self.timeout_s, every_s=0.5, sync=True)(
                self._call_any, method, timeout)
        except _NoLeaderYet:
            raise CtlError(f"no leader elected after {self.timeout_s:.0f}s; is etcd reachable from the daemons?",
                           EXIT_UNREACHABLE) from None

    def _call_any(self, method: Callable[[pb_grpc.ControlStub], Any], timeout: float) -> Any:
        last: CtlError | None = None
        for endpoint in self.endpoints:
            try:
                return self._call_once(endpoint, method, timeout)
            except CtlError as e:
                if e.code not in (EXIT_UNREACHABLE, EXIT_NOT_ELASTICD, EXIT_ETCD_DOWN):  # another may do
                    raise
                last = e
        assert last is not None
        raise last

    def _call_once(self, endpoint: str, method: Callable[[pb_grpc.ControlStub], Any], timeout: float) -> Any:
        for _ in range(2):
            with self.tls.channel(endpoint) as ch:
                try:
                    return method(pb_grpc.ControlStub(ch))(timeout=timeout)
                except grpc.RpcError as e:
                    code, details = e.code(), e.details() or ""
                    if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(NOT_LEADER_PREFIX):
                        nxt = details[len(NOT_LEADER_PREFIX):]
                        if ":" not in nxt:
                            raise _NoLeaderYet()
                        local_only(nxt, endpoint, "the leader")
                        if nxt != endpoint:
                            endpoint = nxt
                            continue
                    raise _error(code, details, endpoint) from None
        raise CtlError("no leader answered; retry in a few seconds", EXIT_UNREACHABLE)

    def node_id(self, address: str) -> str:
        """The node id of the elasticd at ``address`` ("" when it does not answer)."""
        with self.tls.channel(address) as ch:
            try:
                return str(pb_grpc.AgentStub(ch).Status(pb.AgentStatusRequest(), timeout=self.timeout_s).node_id)
            except grpc.RpcError:
                return ""

    def agent_logs(self, address: str, request: pb.LogsRequest) -> Any:
        """Stream a rank's log from the agent at ``address`` (yields LogChunks)."""
        with self.tls.channel(address) as ch:
            try:
                yield from pb_grpc.AgentStub(ch).Logs(request, timeout=None if request.follow else self.timeout_s)
            except grpc.RpcError as e:
                raise _error(e.code(), e.details() or "", address) from None


def _error(code: grpc.StatusCode, details: str, endpoint: str) -> CtlError:
    first = details.splitlines()[0] if details else code.name
    if code == grpc.StatusCode.UNAVAILABLE and details.startswith(ETCD_UNAVAILABLE_PREFIX):
        return CtlError(f"elasticd at {endpoint} answered but cannot reach etcd ({first}); check that etcd runs and "
                        "elasticd's etcd_endpoint", EXIT_ETCD_DOWN)
    if code == grpc.StatusCode.UNIMPLEMENTED or "http2 header with status" in details:
        return CtlError(f"{endpoint} is not an elasticd ({first}); check --endpoints (or $ELASTICCTL_ENDPOINTS): "
                        "elasticd's listen address, not etcd's or another server's", EXIT_NOT_ELASTICD)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CtlError(f"cannot reach elasticd at {endpoint}: {details.splitlines()[0] if details else code.name}; "
                        "check --endpoints (or $ELASTICCTL_ENDPOINTS) and the TLS flags", EXIT_UNREACHABLE)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return CtlError(details, EXIT_USAGE)
    return CtlError(details, EXIT_REFUSED)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        raise CtlError(f"{message}; see {self.prog} --help", EXIT_USAGE)


#: Adds a subcommand: (name, help, example, output) -> its parser.
_Command = Callable[..., argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="elasticctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"elasticctl {__version__}")
    _global_options(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def cmd(name: str, help: str, example: str, output: bool = True) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=f"{help[0].upper()}{help[1:]}.\n\nExample: {example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if output:
            s.add_argument("-o", "--output", choices=render.FORMATS, default="table", help="output format")
        return s

    for add in (_looking, _job_actions, _setting_up, _job_records, _node_actions, _following):
        add(cmd)
    return p


def _global_options(p: argparse.ArgumentParser) -> None:
    """Where elasticd is and how to prove who we are."""
    env = os.environ.get
    default = env("ELASTICCTL_ENDPOINTS") or env("ELASTICCTL_ENDPOINT") or next(
        ("unix:" + p for p in default_sockets() if os.access(p, os.R_OK | os.W_OK)), None)
    p.add_argument("--endpoints", "--endpoint", dest="endpoints", default=default,
                   help=f"comma-separated elasticd host:port or unix:PATH (env ELASTICCTL_ENDPOINTS; default: the "
                        f"local elasticd's socket when this user may open it, else {FALLBACK}; here "
                        f"{default or FALLBACK})")
    p.add_argument("--cacert", default=env("ELASTICCTL_CACERT", ""), help="verify elasticd with this CA (PEM)")
    p.add_argument("--cert", default=env("ELASTICCTL_CERT", ""), help="client certificate (PEM), with --key")
    p.add_argument("--key", default=env("ELASTICCTL_KEY", ""), help="client key (PEM), with --cert")
    p.add_argument("--timeout-s", type=float, default=10.0, help="per-call deadline in seconds (default %(default)s)")


def _looking(cmd: _Command) -> None:
    """Commands that show the cluster, its jobs and their logs."""
    s = cmd("status", "the leader, the nodes and every job (or one)", "elasticctl status lenet -o json")
    s.add_argument("job", nargs="?", default="")
    s = cmd("nodes", "registered nodes: slots, cordoned or draining, jobs running there",
            "elasticctl nodes; elasticctl nodes --wait n1 (once n1 has registered)")
    s.add_argument("--wait", metavar="NODE", default="",
                   help=f"first wait until NODE has registered (up to {NODE_WAIT_S:.0f} s, for elasticd to start "
                        f"too; exit 1 if it does not)")
    cmd("jobs", "every job: state, generation, world size, step, loss", "elasticctl jobs -o yaml")
    s = cmd("describe", "one job in detail (spec, members, generations, recent events), or one node (its devices)",
            "elasticctl describe job lenet; elasticctl describe node n0")
    s.add_argument("kind", choices=["job", "node"])
    s.add_argument("job", metavar="NAME")
    s = cmd("events", "a job's timeline: generations, faults, detection and recovery times",
            "elasticctl events lenet --progress")
    s.add_argument("job")
    s.add_argument("--progress", action="store_true", help="also the periodic step records")
    s.add_argument("--notes", action="store_true",
                   help="also the notes (what the job waits for or leaves out, each time it changes)")
    s = cmd("logs", "a rank's log, streamed from the node that runs (or ran) it", "elasticctl logs lenet --rank 1 -f",
            output=False)
    s.add_argument("job")
    s.add_argument("--rank", type=_bounded(0, INT32_MAX), required=True)
    s.add_argument("--generation", type=_bounded(0, INT64_MAX), default=0,
                   help="an earlier generation (default: the current one)")
    s.add_argument("-f", "--follow", action="store_true",
                   help="keep streaming until the generation ends (waits up to 60 s for a generation still starting)")
    s.add_argument("--tail-bytes", type=_bounded(0, INT64_MAX), default=0, help="start this many bytes before the end")
    s.add_argument("--all", action="store_true",
                   help="also MindSpore's own [WARNING]/[INFO] lines (left out by default: most of a log, and some "
                        "read like failures that are not)")

def _job_actions(cmd: _Command) -> None:
    """Commands that start, stop and restart jobs."""
    s = cmd("submit", "submit a job spec (TOML), validated here first", "elasticctl submit job.toml")
    s.add_argument("spec")
    s.add_argument("--force", action="store_true",
                   help="submit even if checkpoint_dir holds a checkpoint at or past total_steps (refused otherwise)")
    s = cmd("stop", "stop a job: ranks checkpoint a few steps ahead, then exit; returns once they have (events "
                    "and status then name the step)", "elasticctl stop lenet")
    s.add_argument("job")
    s.add_argument("--grace-period-s", type=float, default=0.0, help="0: the job spec's stop_grace_period_s")
    s = cmd("restart", "relaunch a running job: checkpoint a few steps ahead, resume there", "elasticctl restart lenet")
    s.add_argument("job")

def _setting_up(cmd: _Command) -> None:
    """Commands that make certificates and install the unit."""
    s = cmd("certs", "make a CA (certs ca DIR), a certificate it signs (certs issue DIR NAME --role ROLE; again to "
            "renew it), or revoke one (certs revoke DIR NAME: DIR/crl.pem, elasticd's tls_crl)",
            "elasticctl certs issue /etc/mselastic/pki node-a --role node --host 10.0.0.1 --days 90", output=False)
    s.add_argument("action", choices=("ca", "issue", "revoke"))
    s.add_argument("dir", help="where the CA is (ca.pem, ca-key.pem) and the certificate goes")
    s.add_argument("name", nargs="?", default="", help="issue: the node id (role node) or who it is for (CN)")
    s.add_argument("--role", choices=ROLES, default="", help="issue: node, admin or viewer (the certificate's O)")
    s.add_argument("--host", action="append", default=[], help="issue, role node: an address or name the node is "
                                                                "reached at (repeat)")
    s.add_argument("--days", type=_bounded(1, 36500), default=0,
                   help=f"ca, issue: how long it is valid (default: a CA {CA_DAYS} days, a certificate {CERT_DAYS})")
    s = cmd("install-unit", "install elasticd's systemd unit (ExecStart: the elasticd beside this elasticctl), the "
            "mselastic user the jobs run as (sysusers.d) and /etc/mselastic/elasticd.toml if absent; starts nothing",
            "elasticctl install-unit && systemctl enable --now elasticd", output=False)
    s.add_argument("--root", default="/", help="install under this directory instead (an image being built); "
                                               "then no user is created and systemd is not reloaded")

def _job_records(cmd: _Command) -> None:
    """Commands that delete or rescale jobs."""
    s = cmd("delete", "forget a finished job's records (its checkpoints and logs stay); the name can be "
            "submitted again and resumes from the checkpoint_dir", "elasticctl delete lenet")
    s.add_argument("job")
    s = cmd("scale", "change a job's node range (relaunches when the current size leaves it)",
            "elasticctl scale lenet --min 1 --max 4")
    s.add_argument("job")
    s.add_argument("--min", type=_bounded(0, MAX_INTS["min_nodes"]), default=0, help="new min_nodes (default: unchanged)")
    s.add_argument("--max", type=_bounded(0, MAX_INTS["max_nodes"]), default=0, help="new max_nodes (default: unchanged)")

def _node_actions(cmd: _Command) -> None:
    """Commands that cordon, drain and uncordon nodes."""
    s = cmd("cordon", "no new generations on a node (running ones go on), or on one of its devices",
            "elasticctl cordon n1 --reason disk; elasticctl cordon n1 --device 3")
    s.add_argument("node")
    s.add_argument("--reason", default="")
    s.add_argument("--device", type=int, help="set this device of the node aside, not the node")
    s = cmd("drain", "cordon a node and move its running jobs off it (planned, nothing lost); waits",
            "elasticctl drain n1 --wait-s 600")
    s.add_argument("node")
    s.add_argument("--reason", default="")
    s.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the drain (default %(default)s); 0: do not wait; fails at once when no node can take a job")
    s = cmd("uncordon", "let a node (or one of its devices set aside) run generations again (a running job may "
            "scale up to it)", "elasticctl uncordon n1; elasticctl uncordon n1 --device 3")
    s.add_argument("node")
    s.add_argument("--device", type=int, help="put this device of the node back, not the node")
    s = cmd("remove-node", "forget a node taken out of the cluster for good: its cordon and its devices' records "
            "(refused while its elasticd runs or a job still counts on it)",
            "elasticctl drain n1; (on n1: systemctl disable --now elasticd); elasticctl remove-node n1")
    s.add_argument("node")

def _following(cmd: _Command) -> None:
    """Commands that follow a job (live view, report)."""
    s = cmd("watch", "a live view of a job until it ends (lines when not a terminal)",
            "elasticctl watch lenet; elasticctl watch lenet --until-step 20 (in a script: wait for it)", output=False)
    s.add_argument("job")
    s.add_argument("--interval-s", type=float, default=1.0, help="refresh period (default %(default)s)")
    s.add_argument("--until", metavar="STATE", default="",
                   help="stop watching once the job is in STATE (running, restarting, ...; exit 0), or has ended "
                        "otherwise (exit 1)")
    s.add_argument("--until-step", metavar="N", type=int, default=0,
                   help="stop watching once the job has reached step N (exit 0), or has ended before (exit 1)")
    s = cmd("report", "draw a job's run: step over wall time, generations, faults, world size (PNG)",
            "elasticctl report lenet -o timeline.png", output=False)
    s.add_argument("job")
    s.add_argument("-o", "--output", required=True, help="the PNG file to write")


INT64_MAX = 2**63 - 1


def _bounded(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in lo..hi (the wire's int32/int64 would refuse more with a traceback)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not in {lo}..{hi}")
        return value
    return parse


def _grace(v: float) -> float:
    if not 0 <= v <= MAX_SECONDS:  # NaN fails too
        raise CtlError(f"--grace-period-s must be a number of seconds in 0..{MAX_SECONDS:.0f}", EXIT_USAGE)
    return v


def run(argv: list[str] | None, out: Any = sys.stdout) -> int:
    args = build_parser().parse_args(argv)
    args.deadline = time.monotonic() + NODE_WAIT_S  # (nodes --wait: for the socket and the node together)
    if args.endpoints is None and args.command == "nodes" and args.wait:  # (an elasticd starting: its socket first)
        args.endpoints = _socket_within(NODE_WAIT_S)
    if args.endpoints is None:
        args.endpoints = FALLBACK
        if args.command not in ("certs", "install-unit"):
            # (Else nothing would say that another user's elasticd answers, over TCP, as to a viewer.)
            print(f"elasticctl: no elasticd socket this user may open ({', '.join(default_sockets())}): asking "
                  f"{FALLBACK} over TCP, where one may only look; --endpoint names another elasticd", file=sys.stderr)
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    if not endpoints or any(":" not in e for e in endpoints):
        raise CtlError(f"--endpoints {args.endpoints!r} must be host:port or unix:PATH[,...]", EXIT_USAGE)
    if bool(args.cert) != bool(args.key):
        raise CtlError("--cert and --key go together", EXIT_USAGE)
    for flag in ("cacert", "cert", "key"):
        if getattr(args, flag) and not os.path.isfile(getattr(args, flag)):
            raise CtlError(f"--{flag} {getattr(args, flag)!r} is not a readable file", EXIT_USAGE)
    if args.timeout_s <= 0:
        raise CtlError("--timeout-s must be > 0", EXIT_USAGE)
    c = Client(endpoints, TlsFiles(args.cacert, args.cert, args.key), args.timeout_s)
    handler = COMMANDS[args.command]
    return handler(c, args, out)


def _status(c: Client, job: str = "") -> pb.StatusResponse:
    return c.call(lambda s: lambda **kw: s.Status(pb.StatusRequest(job=job), **kw))


def cmd_status(c: Client, a: argparse.Namespace, out: Any) -> int:
    res = _status(c, a.job)
    render.emit(out, a.output, res, lambda: render.status_table(res))
    return EXIT_OK


def cmd_nodes(c: Client, a: argparse.Namespace, out: Any) -> int:
    deadline = getattr(a, "deadline", time.monotonic() + NODE_WAIT_S)
    while True:
        try:
            res = _status(c)
        except CtlError as e:  # (with --wait, an elasticd still starting may not answer yet)
            if not a.wait or e.code not in (EXIT_UNREACHABLE, EXIT_ETCD_DOWN) or time.monotonic() > deadline:
                raise
        else:
            if not a.wait or any(n.node_id == a.wait for n in res.nodes):
                break
        if time.monotonic() > deadline:
            raise CtlError(f"node {a.wait} did not register within {NODE_WAIT_S:.0f} s (is its elasticd running? its "
                           f"log says why not)", EXIT_REFUSED)
        time.sleep(0.2)
    render.emit(out, a.output, {"nodes": [render.as_dict(n) for n in res.nodes], "leader": res.leader},
                lambda: render.nodes_table(res))
    return EXIT_OK


def cmd_jobs(c: Client, a: argparse.Namespace, out: Any) -> int:
    res = _status(c)
    render.emit(out, a.output, {"jobs": [render.as_dict(j) for j in res.jobs]}, lambda: render.jobs_table(list(res.jobs)))
    return EXIT_OK


def _events(c: Client, job: str) -> list[pb.Event]:
    return list(c.call(lambda s: lambda **kw: s.Events(pb.EventsRequest(job=job), **kw)).events)


def cmd_describe(c: Client, a: argparse.Namespace, out: Any) -> int:
    if a.kind == "node":
        node = next((n for n in _status(c).nodes if n.node_id == a.job), None)
        if node is None:
            raise CtlError(f"no node named {a.job!r} is registered (see elasticctl nodes)", EXIT_REFUSED)
        render.emit(out, a.output, node, lambda: render.nodes_table(pb.StatusResponse(nodes=[node])))
        return EXIT_OK
    res = c.call(lambda s: lambda **kw: s.Describe(pb.DescribeRequest(job=a.job), **kw))
    events = _events(c, a.job)
    render.emit(out, a.output, res, lambda: render.describe_table(res, events))
    return EXIT_OK


def cmd_events(c: Client, a: argparse.Namespace, out: Any) -> int:
    hidden = {EventKind.PROGRESS.value} - ({EventKind.PROGRESS.value} if a.progress else set())
    hidden |= set() if a.notes else {EventKind.NOTE.value}
    events = [e for e in _events(c, a.job) if e.kind not in hidden]
    render.emit(out, a.output, {"events": [render.as_dict(e) for e in events]}, lambda: render.events_table(events))
    return EXIT_OK


def cmd_logs(c: Client, a: argparse.Namespace, out: Any) -> int:
    res = c.call(lambda s: lambda **kw: s.Describe(pb.DescribeRequest(job=a.job), **kw))
    plans = {p.generation: plan_from_pb(p) for p in res.plans}
    gen = a.generation or res.status.generation
    if gen not in plans:
        raise CtlError(f"job {a.job} has no generation {gen} (it has {', '.join(map(str, plans)) or 'none'})",
                       EXIT_REFUSED)
    m = plans[gen].member_of_rank(a.rank)
    if m is None:
        raise CtlError(f"generation {gen} of {a.job} has ranks 0..{plans[gen].world_size - 1}, not {a.rank}",
                       EXIT_REFUSED)
    request = pb.LogsRequest(job=a.job, rank=a.rank, generation=gen, follow=a.follow, tail_bytes=a.tail_bytes)
    address = m.agent_address
    local = next((e for e in c.endpoints if e.startswith("unix:")), "")
    if local and c.node_id(local) == m.node_id:
        address = local  # this node's own agent: through the socket, where logs may be read
    local_only(address, local, f"node {m.node_id}")
    stream = getattr(out, "buffer", None)
    lines = LogLines(everything=a.all, terminal=out.isatty())

    def write(data: bytes) -> None:
        if stream is not None:
            stream.write(data)
            stream.flush()
        else:
            out.write(data.decode(errors="replace"))

    try:
        for chunk in c.agent_logs(address, request):
            write(lines.feed(chunk.data))
        write(lines.end())
    except CtlError as e:
        raise CtlError(f"node {m.node_id}: {e}", e.code) from None
    return EXIT_OK


def cmd_submit(c: Client, a: argparse.Namespace, out: Any) -> int:
    try:
        spec = load_toml(a.spec)
    except SpecError as e:
        raise CtlError(f"{a.spec}: {e}", EXIT_USAGE) from None
    res = c.call(lambda s: lambda **kw: s.Submit(pb.SubmitRequest(spec_json=spec.to_json(), force=a.force), **kw))
    if res.warning:
        print(f"elasticctl: warning: {res.warning}", file=sys.stderr)
    render.emit(out, a.output, {"job": res.job, "submitted": True}, lambda: f"job {res.job} submitted")
    return EXIT_OK


def cmd_stop(c: Client, a: argparse.Namespace, out: Any) -> int:
    req = pb.StopJobRequest(job=a.job, grace_period_s=_grace(a.grace_period_s))
    res = c.call(lambda s: lambda **kw: s.StopJob(req, **kw), timeout_s=c.timeout_s + 60)
    render.emit(out, a.output, {"job": a.job, "state": render.state(res.state)},
                lambda: f"job {a.job} {render.state(res.state)}")
    return EXIT_OK


def cmd_restart(c: Client, a: argparse.Namespace, out: Any) -> int:
    res = c.call(lambda s: lambda **kw: s.Restart(pb.RestartRequest(job=a.job), **kw))
    render.emit(out, a.output, {"job": a.job, "generation": res.generation},
                lambda: f"job {a.job} restarting as generation {res.generation} (checkpoint a few steps ahead)")
    return EXIT_OK


def cmd_delete(c: Client, a: argparse.Namespace, out: Any) -> int:
    res = c.call(lambda s: lambda **kw: s.DeleteJob(pb.DeleteJobRequest(job=a.job), **kw))
    render.emit(out, a.output, {"job": a.job, "deleted": True, "last_generation": res.generation},
                lambda: f"job {a.job} deleted (last generation {res.generation}; checkpoints and logs kept)")
    return EXIT_OK


def cmd_scale(c: Client, a: argparse.Namespace, out: Any) -> int:
    if not (a.min or a.max):  # negatives are refused by their argparse type
        raise CtlError("give --min and/or --max, positive", EXIT_USAGE)
    res = c.call(lambda s: lambda **kw: s.Scale(pb.ScaleRequest(job=a.job, min_nodes=a.min, max_nodes=a.max), **kw))
    if res.warning:
        print(f"elasticctl: warning: {res.warning}", file=sys.stderr)
    render.emit(out, a.output, {"job": a.job, "min_nodes": res.min_nodes, "max_nodes": res.max_nodes},
                lambda: f"job {a.job} scaled to {res.min_nodes}..{res.max_nodes} nodes")
    return EXIT_OK


def cmd_cordon(c: Client, a: argparse.Namespace, out: Any) -> int:
    cordon, drain = a.command != "uncordon", a.command == "drain"
    req = pb.CordonRequest(node_id=a.node, cordon=cordon, drain=drain, reason=getattr(a, "reason", ""))
    if a.command == "remove-node":
        req = pb.CordonRequest(node_id=a.node, remove=True)
        res = c.call(lambda s: lambda **kw: s.Cordon(req, **kw))
        render.emit(out, a.output, {"node": a.node, "removed": res.removed},
                    lambda: f"node {a.node} removed ({res.removed} record(s) deleted)")
        return EXIT_OK
    device = getattr(a, "device", None)
    if device is not None:
        if device < 0:
            raise CtlError(f"--device {device}: a device id is 0 or more", EXIT_USAGE)
        req.device = device
        c.call(lambda s: lambda **kw: s.Cordon(req, **kw))
        render.emit(out, a.output, {"node": a.node, "device": device, "cordoned": cordon},
                    lambda: f"node {a.node} device {device} {a.command}ed")
        return EXIT_OK
    c.call(lambda s: lambda **kw: s.Cordon(req, **kw))
    if drain and a.wait_s > 0:
        _wait_drained(c, a)
    render.emit(out, a.output, {"node": a.node, "cordoned": cordon, "draining": drain},
                lambda: f"node {a.node} {a.command}ed")
    return EXIT_OK


def _wait_drained(c: Client, a: argparse.Namespace) -> None:
    """Until no unfinished job has the node in its current generation, and nothing runs there."""
    shown: list[str] = []
    stuck_since: dict[str, float] = {}

    def jobs_on_node() -> list[pb.JobStatus]:
        res = _status(c)
        running = {j for n in res.nodes if n.node_id == a.node for j in n.running_jobs}
        left = [j for j in res.jobs if j.job in running or (render.state(j.state) in ("PENDING", "RUNNING", "RESTARTING")
                                                            and any(m.node_id == a.node for m in j.members))]
        # The coordinator says no node can take these jobs. A note that old (from an earlier
        # drain) is replaced within a pass or two of the cordon: believe one that lasts 3 s.
        now = time.monotonic()
        notes = {j.job: j.note for j in left if j.note.startswith("drain of") and " waits: " in j.note}
        for job in list(stuck_since):
            if job not in notes:
                del stuck_since[job]
        for job in notes:
            stuck_since.setdefault(job, now)
        stuck = [j for j in left if j.job in notes and now - stuck_since[j.job] >= 3.0]
        if stuck:  # say so now, not after --wait-s
            raise CtlError(f"node {a.node} cannot be drained now: " + "; ".join(f"job {j.job}: {j.note}" for j in stuck)
                           + f"; it stays cordoned and draining (elasticctl uncordon {a.node} to undo)", EXIT_REFUSED)
        line = ", ".join(f"{j.job} (generation {j.generation}, {render.state(j.state)})" for j in left)
        if left and line not in shown:  # progress, on stderr: stdout keeps the command's result
            shown.append(line)
            print(f"draining {a.node}: waiting for {line}", file=sys.stderr, flush=True)
        return left

    try:
        retries.polling(a.wait_s, every_s=1.0, sync=True)(jobs_on_node)
    except tenacity.RetryError as e:
        left = e.last_attempt.result()
        why = "; ".join(f"{j.job}: {j.note or j.message}" for j in left)
        raise CtlError(f"node {a.node} still runs {', '.join(j.job for j in left)} after {a.wait_s:.0f}s "
                       f"({why}); it stays cordoned and draining", EXIT_REFUSED) from None


def cmd_watch(c: Client, a: argparse.Namespace, out: Any) -> int:
    from mselastic.ctl.watch import watch

    if a.interval_s <= 0:
        raise CtlError("--interval-s must be > 0", EXIT_USAGE)
    until = (a.until or "").upper()
    if until and until not in WATCHABLE:
        raise CtlError(f"--until {a.until!r}: one of {', '.join(s.lower() for s in WATCHABLE)}", EXIT_USAGE)
    if a.until_step < 0:
        raise CtlError("--until-step must be >= 0", EXIT_USAGE)
    j = watch(lambda: _status(c, a.job), a.job, a.interval_s, out, until, a.until_step)
    if a.until_step:
        return EXIT_OK if j.step >= a.until_step else EXIT_REFUSED
    return EXIT_OK if render.state(j.state) == (until or "SUCCEEDED") else EXIT_REFUSED


def cmd_report(c: Client, a: argparse.Namespace, out: Any) -> int:
    from mselastic.ctl.report import draw

    if not a.output.lower().endswith(".png"):
        raise CtlError(f"-o {a.output!r}: the report is a PNG; name the file *.png", EXIT_USAGE)
    res = c.call(lambda s: lambda **kw: s.Describe(pb.DescribeRequest(job=a.job), **kw))
    events = _events(c, a.job)
    try:
        draw(res, events, a.output)
    except OSError as e:
        raise CtlError(f"cannot write {a.output}: {e.strerror}", EXIT_USAGE) from None
    print(f"wrote {a.output}", file=out)
    return EXIT_OK


def cmd_install_unit(c: Client, a: argparse.Namespace, out: Any) -> int:
    try:
        for line in systemd.install(a.root):
            out.write(line + "\n")
    except systemd.InstallError as e:
        raise CtlError(str(e), EXIT_REFUSED) from None
    if os.path.realpath(a.root) == "/":
        out.write("next: edit /etc/mselastic/elasticd.toml (node_id, etcd_endpoint, ...), then systemctl enable "
                  "--now elasticd\n")
    return EXIT_OK


def cmd_certs(c: Client, a: argparse.Namespace, out: Any) -> int:
    """Certificates without a PKI team: one CA, and node/admin/viewer certificates it signs."""
    try:
        if a.action == "ca":
            cert, key = make_ca(a.dir, days=a.days or CA_DAYS)
            out.write(f"CA: {cert} (give it to every node and elasticctl: tls_cacert / --cacert); key: {key} "
                      f"(keep it off the nodes); revocation list: {os.path.join(a.dir, 'crl.pem')} (empty; every "
                      f"node's tls_crl)\n")
            return EXIT_OK
        if a.action == "revoke":
            if not a.name:
                raise CtlError("certs revoke needs the NAME of a certificate the CA in DIR signed (or its .pem file)",
                               EXIT_USAGE)
            crl, serial = revoke(a.dir, a.name)
            out.write(f"revoked {a.name} (serial {serial:x}); copy {crl} to every node (their tls_crl): it is "
                      f"refused from the next call on, no restart\n")
            return EXIT_OK
        if not a.name or not a.role:
            raise CtlError("certs issue needs a NAME and --role node|admin|viewer", EXIT_USAGE)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", a.name):
            raise CtlError(f"certificate name {a.name!r}: letters, digits, '.', '_', '-' (a node id)", EXIT_USAGE)
        cert, key = issue(a.dir, a.name, a.role, tuple(a.host), days=a.days or CERT_DAYS)
    except TlsError as e:
        raise CtlError(str(e), EXIT_USAGE) from None
    out.write(f"{a.role} certificate for {a.name}: {cert}, key {key} (mode 0600); {describe(cert)}\n")
    return EXIT_OK


COMMANDS: dict[str, Callable[[Client, argparse.Namespace, Any], int]] = {
    "status": cmd_status, "nodes": cmd_nodes, "jobs": cmd_jobs, "describe": cmd_describe, "events": cmd_events,
    "logs": cmd_logs, "submit": cmd_submit, "stop": cmd_stop, "restart": cmd_restart, "scale": cmd_scale,
    "delete": cmd_delete, "certs": cmd_certs, "install-unit": cmd_install_unit,
    "cordon": cmd_cordon, "drain": cmd_cordon, "uncordon": cmd_cordon, "remove-node": cmd_cordon, "watch": cmd_watch, "report": cmd_report,
}


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except CtlError as e:
        print(f"elasticctl: {e}", file=sys.stderr)
        return e.code
    except TlsError as e:
        print(f"elasticctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
