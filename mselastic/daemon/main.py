"""elasticd: one per node. Agent for its node, candidate for coordinator, Control endpoint.

Example (a single machine, embedded etcd)::

    elasticd --node-id n0 --embedded-etcd-dir /var/lib/mselastic/etcd --slots 2

Example (a node of a cluster with an existing etcd)::

    elasticd --node-id gpu-07 --etcd-endpoint 10.0.0.2:2379 --listen 0.0.0.0:7070 \\
             --advertise-host 10.0.0.7 --slots 8

Settings come from, in rising order of precedence: defaults, the config file
(/etc/mselastic/elasticd.toml, or --config / $ELASTICD_CONFIG; keys as the flags with
'_' for '-', see mselastic/systemd/elasticd.toml), ELASTICD_<KEY> environment variables, flags.
A bad value is refused at start with one line naming the key and where it came from
(exit 2).

Under systemd (Type=notify): READY=1 once registered, WATCHDOG=1 every half
watchdog timeout (a WatchdogSec longer than half of fenced_within(lease_ttl_s) is
shortened to it with WATCHDOG_USEC=), STOPPING=1 on the way out. Metrics for
Prometheus on --metrics-listen.

SIGTERM or SIGINT: local workers are asked to checkpoint (SIGTERM, grace
period), then killed; fencing goes on meanwhile (and an event loop that stops for
the watchdog timeout kills elasticd, its workers with it); once they are gone the
node's registration is revoked; exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import grp
import hashlib
import ipaddress
import logging
import os
import re
import signal
import socket
import stat
import sys
import tomllib
from typing import Callable, NoReturn

import grpc

from mselastic.agent import procs
from mselastic.agent.node import AgentConfig, NodeAgent, NodeIdTaken
from mselastic.agent.service import AgentService
from mselastic.agent.users import UserError, WorkerUser, cannot_run_python, cannot_start_batch, resolve
from mselastic.core import fencing
from mselastic.core.contract import default_sockets
from mselastic.core.model import LeaderRecord, MalformedRecord
from mselastic.core.planner import PortRange
from mselastic import metrics
from mselastic.daemon import liveness, logs, notify
from mselastic.daemon.auth import Authorizer
from mselastic.daemon.control import ControlService
from mselastic.daemon.coordinator import Coordinator, CoordinatorConfig
from mselastic.store.embedded import EmbeddedEtcd, etcd_binary, etcd_version
from mselastic.store import versions
from mselastic.store.etcd import EtcdAuth, PermanentError, RetryPolicy, Store, TemporaryError
from mselastic.store.keys import BadName, Keys, check_id
from mselastic.tls import TlsError, TlsFiles, private_pki
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

log = logging.getLogger("elasticd")


DEFAULT_CONFIG = "/etc/mselastic/elasticd.toml"
#: How a true/false setting is written in a flag or an environment variable.
BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
#: The largest gRPC request elasticd accepts.
MAX_REQUEST_BYTES = 1 << 20
ENV_PREFIX = "ELASTICD_"


class SettingsError(ValueError):
    """A bad setting: the message names the key and where its value came from."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every key of the config file (``/etc/mselastic/elasticd.toml``), environment variable
    (``ELASTICD_<KEY>``) and flag (``--<key>``); later ones win in that order."""

    #: This node's id (etcd key name): letters, digits, '.', '_', '-'. Default: the host name.
    node_id: str = ""
    #: etcd client endpoint host:port, or several comma-separated (the members of a cluster);
    #: with embedded_etcd_dir, the single address the embedded member listens on.
    etcd_endpoint: str = "127.0.0.1:2379"
    #: Start a single-member etcd on loopback with its data here (a first run on one machine).
    embedded_etcd_dir: str = ""
    #: host:port the gRPC services (Agent, Control) listen on.
    listen: str = "127.0.0.1:7070"
    #: Address other nodes reach this one at; msrun's master_addr when this is node_rank 0.
    #: Default: the listen host, or the host name when listening on all addresses.
    advertise_host: str = ""
    #: Workers this node can run; 0 makes it a coordinator-only node.
    slots: int = 1
    #: Logs of every generation are kept under <work_dir>/logs/<job>/g<generation>.
    work_dir: str = "/var/lib/mselastic"
    #: etcd key namespace (several clusters may share one etcd).
    namespace: str = "/mselastic"
    #: TTL of node registration and leader leases: a dead node is noticed this fast.
    lease_ttl_s: int = 5
    #: The leader reconciles at least this often (and on every etcd change).
    reconcile_interval_s: float = 1.0
    #: Grace period for local workers to checkpoint when elasticd itself is stopped.
    shutdown_grace_s: float = 10.0
    #: First master port and how many to choose from (outside msrun's 8118-16309).
    master_port_start: int = 20000
    master_port_span: int = 5000
    #: The leader records each running job's step in its event log this often (for
    #: `elasticctl report`); 0: never.
    progress_interval_s: float = 10.0
    #: Events kept per job (the oldest are deleted as new ones come), and for at most this long.
    keep_events: int = 2000
    keep_events_s: float = 30 * 24 * 3600.0
    #: Generations whose agent reports are kept per job (older ones are deleted at a relaunch).
    keep_report_generations: int = 50
    #: host:port of the Prometheus metrics endpoint (/metrics); empty: none.
    metrics_listen: str = "127.0.0.1:9464"
    #: TLS for the gRPC port: this node's certificate and key (PEM); both or neither.
    tls_cert: str = ""
    tls_key: str = ""
    #: CA that signed the peers' and clients' certificates; with tls_cert, clients must present one.
    tls_cacert: str = ""
    #: etcd over TLS (named like etcdctl's --cacert, --cert, --key): the CA of etcd's certificate,
    #: and a client certificate and key (etcd with --client-cert-auth takes its CN as the user).
    #: (An embedded etcd ignores them: it uses a private CA in embedded_etcd_dir/pki.)
    etcd_cacert: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    #: etcd's user and password (after `etcdctl auth enable`), when not a certificate's CN.
    etcd_user: str = ""
    etcd_password: str = ""
    #: One exact etcd server version to accept although it is below the supported ones
    #: (mselastic.store.versions.POLICY); warned about in the log and in `elasticctl status`.
    etcd_accept_version: str = ""
    #: "text" or "json".
    log_format: str = "text"
    #: The user the workers run as (when elasticd is root). Default: mselastic if that user
    #: exists, else nobody; "root" runs every job's script as root and must be written out.
    worker_user: str = ""
    #: Loader or interpreter variables (LD_*, PYTHON*, PATH, ...) a job's env may set anyway,
    #: comma-separated: each lets a job run code of its choosing before its script.
    allow_env: str = ""
    #: elasticd's own environment variables the workers inherit besides locale, PATH, proxies,
    #: PYTHONPATH, LD_LIBRARY_PATH and MS_*, GLOG_*, ASCEND_*, HCCL_*: names, or prefixes as NAME*.
    pass_env: str = ""
    #: Serve plaintext gRPC on an address other machines reach (no TLS): anyone who reaches it
    #: can submit jobs. Only on a network where that is acceptable.
    insecure: bool = False
    #: The local Unix socket: whoever may open it is admin (elasticctl's default endpoint).
    #: "": /run/mselastic/elasticd.sock for root, else $XDG_RUNTIME_DIR/mselastic/elasticd.sock
    #: (or ~/.mselastic/elasticd.sock).
    socket: str = ""
    #: Group that may open the socket (mode 0660; "": elasticd's user alone, 0600). Never a group
    #: the worker user is in: every job's script would then administer the cluster.
    socket_group: str = ""
    #: Keep standby workers with MindSpore imported for every job running here (one per local rank
    #: and one for a scheduler): a relaunch hands them the generation instead of starting msrun and
    #: new Pythons. Each costs the memory of an idle Python with MindSpore imported.
    warm_standbys: bool = True
    #: Start the jobs' processes (msrun, its scheduler and workers, the standbys) under SCHED_BATCH,
    #: where MindSpore's registration seldom loses a race with its own event loop; the trainer
    #: library runs init() on one core and then puts a rank back on all its cores under the
    #: default policy (docs/journal/2026-12.md, "... SCHED_BATCH"). false: they inherit elasticd's own policy.
    batch_scheduling: bool = True
    #: While leading, keep a watched connection (keepalive pings) to the agent of every member of
    #: a live plan: a dead node is replaced in about a second instead of at its lease's expiry.
    #: Costs the leader ~6 % of a core at 250 nodes, ~31 % at 4000 (``make bench-liveness``).
    peer_evidence: bool = True
    #: Folder in memory (tmpfs) where the ranks keep snapshots of the training state between
    #: checkpoints (a job's ``snapshot_interval_steps``): ``<snapshot_dir>/<node>-<namespace
    #: hash>/<job>``, removed when the job succeeds here. "": no snapshots on this node.
    snapshot_dir: str = "/dev/shm/mselastic"

    def validate(self) -> "Settings":
        try:
            check_id("node id", self.node_id)
        except BadName as e:
            raise _bad("node_id", str(e)) from None
        try:
            Keys(self.namespace)
        except BadName as e:
            raise _bad("namespace", str(e)) from None
        try:
            PortRange(self.master_port_start, self.master_port_span)
        except ValueError as e:
            raise _bad("master_port_start", str(e)) from None
        for key, value in [("etcd_endpoint", e) for e in self.etcd_endpoint.split(",")] + [
                ("listen", self.listen)] + ([("metrics_listen", self.metrics_listen)] if self.metrics_listen else []):
            host, _, port = value.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise _bad(key, f"{value!r} must be host:port")
        if self.embedded_etcd_dir and "," in self.etcd_endpoint:
            raise _bad("embedded_etcd_dir", "runs one member: give etcd_endpoint a single host:port")
        if self.slots < 0:
            raise _bad("slots", f"must be >= 0 (got {self.slots})")
        if self.lease_ttl_s < 2:
            raise _bad("lease_ttl_s", f"must be >= 2 (got {self.lease_ttl_s})")
        for key in ("reconcile_interval_s", "shutdown_grace_s"):
            if getattr(self, key) <= 0:
                raise _bad(key, f"must be > 0 (got {getattr(self, key)})")
        for key in ("keep_events", "keep_report_generations"):
            if getattr(self, key) < 2:
                raise _bad(key, f"must be >= 2 (got {getattr(self, key)})")
        if not 60 <= self.keep_events_s <= 10 * 365 * 24 * 3600:  # NaN and inf fail too
            raise _bad("keep_events_s", f"must be 60 s to 10 years (got {self.keep_events_s})")
        if self.progress_interval_s < 0:
            raise _bad("progress_interval_s", f"must be >= 0 (got {self.progress_interval_s})")
        if self.log_format not in ("text", "json"):
            raise _bad("log_format", f"must be text or json (got {self.log_format!r})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise _bad("tls_cert" if not self.tls_cert else "tls_key", "tls_cert and tls_key go together")
        for key in ("tls_cert", "tls_key", "tls_cacert"):
            if getattr(self, key) and not os.path.isfile(getattr(self, key)):
                raise _bad(key, f"{getattr(self, key)!r} is not a readable file")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise _bad("etcd_cert" if not self.etcd_cert else "etcd_key", "etcd_cert and etcd_key go together")
        if bool(self.etcd_user) != bool(self.etcd_password):
            raise _bad("etcd_user" if not self.etcd_user else "etcd_password", "etcd_user and etcd_password go together")
        for key in ("etcd_cacert", "etcd_cert", "etcd_key"):
            if getattr(self, key) and not os.path.isfile(getattr(self, key)):
                raise _bad(key, f"{getattr(self, key)!r} is not a readable file")
        if self.tls_cert and not self.tls_cacert:
            raise _bad("tls_cacert", "tls_cert without tls_cacert would accept any client; give the CA that signs the "
                                     "nodes' and clients' certificates")
        for key in ("tls_key", "etcd_key"):
            path = getattr(self, key)
            if path and os.stat(path).st_mode & 0o077:
                raise _bad(key, f"{path} may be read by others (mode {os.stat(path).st_mode & 0o777:o}): chmod 600 it "
                                f"(a key others can read is refused, as ssh does)")
            if path and os.stat(path).st_uid not in (0, os.geteuid()):
                raise _bad(key, f"{path} belongs to uid {os.stat(path).st_uid}, not to elasticd's user: whoever owns "
                                f"it may replace it")
        host = self.listen.rpartition(":")[0].strip("[]")
        if not self.tls_cert and not self.insecure and not _loopback(host):
            raise _bad("listen", f"{self.listen} is reachable from other machines, without TLS: anyone who reaches it "
                                 f"could run jobs here. Give tls_cert, tls_key and tls_cacert, or listen on loopback, "
                                 f"or set insecure = true on a network you trust")
        for key in ("allow_env", "pass_env"):
            for name in _names(getattr(self, key)):
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*" + (r"\*?" if key == "pass_env" else ""), name):
                    raise _bad(key, f"{name!r} is not a variable name" + (" (or NAME*)" if key == "pass_env" else ""))
        return self

    @property
    def etcd_auth(self) -> EtcdAuth:
        """How elasticd proves itself to an external etcd (an embedded one has its own, see serve)."""
        return EtcdAuth(self.etcd_cacert, self.etcd_cert, self.etcd_key, self.etcd_user, self.etcd_password)

    @property
    def allowed_env(self) -> frozenset[str]:
        return _names(self.allow_env)

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(cacert=self.tls_cacert, cert=self.tls_cert, key=self.tls_key)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (a SettingsError: exit 2) instead of the usage text."""

    def error(self, message: str) -> NoReturn:
        raise SettingsError(f"{message}; see elasticd --help")


def _names(text: str) -> frozenset[str]:
    return frozenset(filter(None, (n.strip() for n in text.split(","))))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bad(key: str, message: str) -> SettingsError:
    return SettingsError(f"{key}: {message}")


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _coerce(key: str, value: object, source: str, typed: bool = False) -> object:
    """A config or environment value as the key's type. Environment values are strings by nature
    and are parsed; a config file is typed TOML (``typed``): ``slots = "2"`` is refused."""
    kind = str(FIELDS[key].type)
    ok = True
    if kind == "bool":
        if isinstance(value, str) and not typed and value.lower() in BOOLS:
            return BOOLS[value.lower()]
        if not isinstance(value, bool):
            raise SettingsError(f"{key} (from {source}): must be true or false (got {value!r})")
        return value
    if kind == "str":
        ok = isinstance(value, str)
    elif isinstance(value, bool) or (typed and isinstance(value, str)):
        ok = False
    elif isinstance(value, str):
        try:
            value = int(value) if kind == "int" else float(value)
        except ValueError:
            ok = False
    elif kind == "int":
        ok = isinstance(value, int)
    else:
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value  # type: ignore[arg-type]
    if not ok:
        word = {"int": "an integer", "float": "a number", "str": "a string"}[kind]
        raise SettingsError(f"{key} (from {source}): must be {word} (got {value!r})")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = _Parser(prog="elasticd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help=f"config file (TOML; env ELASTICD_CONFIG; default {DEFAULT_CONFIG}, skipped when absent)")
    helps = {
        "node_id": "this node's id (default: the host name)",
        "etcd_endpoint": "etcd host:port, or a comma-separated list of the cluster's members",
        "embedded_etcd_dir": "run a single-member etcd on loopback, data in DIR",
        "listen": "gRPC host:port for Agent and Control",
        "advertise_host": "address peers use for this node (default: the listen host)",
        "slots": "workers this node can run; 0: coordinate only",
        "work_dir": "logs of each generation go here",
        "namespace": "etcd key prefix",
        "lease_ttl_s": "node and leader lease TTL in seconds",
        "reconcile_interval_s": "leader reconcile period in seconds",
        "shutdown_grace_s": "checkpoint grace for local workers on shutdown",
        "master_port_start": "first master port msrun may get",
        "master_port_span": "how many master ports to choose from",
        "progress_interval_s": "record each job's step this often, for `elasticctl report`; 0: never",
        "keep_events": "events kept per job; older ones are deleted",
        "keep_events_s": "events older than this are deleted (seconds; default 30 days)",
        "keep_report_generations": "generations of agent reports kept per job",
        "metrics_listen": "Prometheus /metrics host:port; empty: none",
        "tls_cert": "this node's TLS certificate (PEM)",
        "tls_key": "this node's TLS key (PEM)",
        "tls_cacert": "CA of the peers' and clients' certificates (PEM)",
        "log_format": "text or json",
        "etcd_cacert": "CA of etcd's certificate (PEM): etcd over TLS",
        "etcd_cert": "client certificate for etcd (PEM; its CN is the etcd user with --client-cert-auth)",
        "etcd_key": "its key (PEM, mode 0600)",
        "etcd_user": "etcd user (auth enabled), with etcd_password",
        "etcd_password": "etcd user's password",
        "etcd_accept_version": "accept this exact etcd version although it is below the supported ones "
                               f"({versions.POLICY}); warned about in the log and in status",
        "worker_user": "user the workers run as (default: mselastic if it exists, else nobody; root only if named)",
        "allow_env": "comma-separated loader/interpreter variables (LD_*, PYTHON*, PATH) jobs may set anyway",
        "pass_env": "comma-separated names (or NAME* prefixes) of elasticd's variables the workers inherit too",
        "socket": "local Unix socket; whoever may open it is admin (elasticctl: --endpoint unix:PATH)",
        "socket_group": "group that may open the socket (default: none, elasticd's user alone); not the workers'",
        "insecure": "true: serve plaintext on a non-loopback listen address (anyone reaching it can run jobs)",
        "warm_standbys": "keep standby workers with MindSpore imported for the jobs here: relaunches skip msrun",
        "batch_scheduling": "start the jobs' processes under SCHED_BATCH (MindSpore's registration then seldom "
                            "loses a race with its own event loop); ranks go back to the default policy after init()",
        "peer_evidence": "while leading, ping the agents of running jobs' nodes: one whose connection drops is asked "
                         "at once what it runs, and replaced as soon as it says nothing",
        "snapshot_dir": "folder in memory (tmpfs) for the jobs' snapshots between checkpoints (\"\": none)",
    }
    for key, f in FIELDS.items():
        kinds: dict[str, Callable[[str], object]] = {"int": int, "float": float, "bool": _flag}
        kind = kinds.get(str(f.type), str)
        default = getattr(d, key)
        p.add_argument("--" + key.replace("_", "-"), type=kind, default=None, dest=key,
                       help=f"{helps[key]} (env {ENV_PREFIX}{key.upper()}; default {default!r})")
    return p


def _flag(text: str) -> bool:
    if text.lower() in BOOLS:
        return BOOLS[text.lower()]
    raise argparse.ArgumentTypeError(f"must be true or false (got {text!r})")


def parse_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Settings from, in rising order: defaults, the config file, ELASTICD_* variables, flags."""
    env = os.environ if environ is None else environ
    a = build_parser().parse_args(argv)
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    path = a.config or env.get(ENV_PREFIX + "CONFIG") or DEFAULT_CONFIG
    if path != DEFAULT_CONFIG or os.path.exists(path):
        for key, value in _read_config(path).items():
            values[key], sources[key] = _coerce(key, value, path, typed=True), path
    for key in FIELDS:
        name = ENV_PREFIX + key.upper()
        if name in env:
            values[key], sources[key] = _coerce(key, env[name], "$" + name), "$" + name
    for key in FIELDS:
        if getattr(a, key) is not None:
            values[key], sources[key] = getattr(a, key), "--" + key.replace("_", "-")
    if sources.get("etcd_password", "").startswith("--"):
        raise SettingsError("etcd_password (from --etcd-password): a flag is visible to every user in the process "
                            "list; put it in the config file (mode 0600) or $ELASTICD_ETCD_PASSWORD")
    if sources.get("etcd_password") == path and os.stat(path).st_mode & 0o044:
        raise SettingsError(f"etcd_password (from {path}): the file may be read by others (mode "
                            f"{os.stat(path).st_mode & 0o777:o}); chmod 600 it")
    if not values.get("node_id"):
        values["node_id"] = socket.gethostname().split(".")[0]
    try:
        s = Settings(**values)  # type: ignore[arg-type]
        host = s.listen.rpartition(":")[0]
        advertise = s.advertise_host or (host if host not in ("0.0.0.0", "::", "") else socket.gethostname())
        return dataclasses.replace(s, advertise_host=advertise, work_dir=os.path.abspath(s.work_dir),
                                   socket=s.socket or default_sockets()[-1]).validate()
    except SettingsError as e:
        key = str(e).split(":", 1)[0]
        if key in sources and "(from " not in str(e):
            raise SettingsError(f"{key} (from {sources[key]}):{str(e).split(':', 1)[1]}") from None
        raise


def _unusable_dir(path: str) -> str:
    """Why elasticd cannot use ``path`` as a directory of its own ("" when it can); creates it."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable"
    return ""


def _read_config(path: str) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise SettingsError(f"config {path}: cannot read it ({e.strerror}); give --config a readable file") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"config {path}: not valid TOML ({e})") from None
    for key in data:
        if key not in FIELDS:
            raise SettingsError(f"{key} (from {path}): unknown key; known keys are {', '.join(FIELDS)}")
    return data


def snapshot_root(s: "Settings") -> str:
    """This elasticd's own folder under ``snapshot_dir``: several (nodes of a test cluster, two
    namespaces) may share a machine."""
    if not s.snapshot_dir:
        return ""
    return os.path.join(s.snapshot_dir, f"{s.node_id}-{hashlib.sha256(s.namespace.encode()).hexdigest()[:8]}")


def _bind_socket(server: grpc.aio.Server, s: Settings) -> str:
    """Listen on the local socket too (its folder made; a stale socket replaced, a live one
    refused); returns its ``unix:`` target. The folder must be elasticd's own and writable by
    nobody else: whoever could replace the socket there could redirect what is done to it."""
    path = os.path.abspath(s.socket)
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        st = os.lstat(folder)
    except OSError as e:
        raise _bad("socket", f"{folder} cannot be created ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise _bad("socket", f"{folder} must be a folder of elasticd's user that nobody else may write "
                             f"(owner uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise _bad("socket", f"{path} exists and is not a socket; remove it or give another socket path")
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # left by an elasticd that is gone
            else:
                raise _bad("socket", f"{path} is in use by a running elasticd; give this one another socket")
    try:
        if not server.add_insecure_port("unix:" + path):
            raise RuntimeError("bind failed")
    except RuntimeError as e:
        raise _bad("socket", f"cannot listen on {path}: {e}") from None
    return "unix:" + path


def _share_socket(s: Settings, worker: WorkerUser) -> None:
    """Mode 0660 for the socket group, 0600 without one."""
    path = os.path.abspath(s.socket)
    if not stat.S_ISSOCK(os.lstat(path).st_mode):  # (its folder is ours alone: nothing replaced it)
        raise _bad("socket", f"{path} is not the socket elasticd made")
    gid = -1
    if s.socket_group:
        try:
            gid = grp.getgrnam(s.socket_group).gr_gid
        except KeyError:
            raise _bad("socket_group", f"there is no group {s.socket_group!r} on this node") from None
        if gid == worker.gid or gid in worker.groups:
            raise _bad("socket_group", f"the worker user {worker.name} is in group {s.socket_group}: every job's "
                                       f"script could administer the cluster; give the socket another group")
    os.chown(path, -1, gid)
    os.chmod(path, 0o660 if gid >= 0 else 0o600)


async def serve(s: Settings) -> None:
    # Logs, checkpoints and sockets are not for everyone: files 0640, directories 0750 (the
    # workers inherit it through msrun).
    os.umask(0o027)
    try:
        worker = resolve(s.worker_user)
    except UserError as e:
        raise _bad("worker_user", str(e)) from None
    if worker.is_root:
        log.warning("worker_user = root: every job's script runs as root on this node")
    procs.read_as(worker.uid)
    if s.insecure and not s.tls_cert:
        log.warning("insecure = true: plaintext gRPC on %s; anyone who reaches it can run jobs on this cluster",
                    s.listen)
    for key in ("work_dir", "embedded_etcd_dir"):  # checked here, not when parsing: creating them is an action
        path = getattr(s, key)
        if path and (why := _unusable_dir(path)):
            raise _bad(key, f"{path!r} {why}; give a directory elasticd may write (created if missing)")
    if why := await asyncio.to_thread(cannot_run_python, worker):
        raise _bad("worker_user", f"{why}; install mselastic where that user can read it (a system Python, "
                                  f"/opt/mselastic) or name another worker_user")
    if s.batch_scheduling and (why := await asyncio.to_thread(cannot_start_batch, worker)):
        raise _bad("batch_scheduling", f"{why}; set batch_scheduling = false")
    etcd = None
    endpoint, etcd_auth = s.etcd_endpoint, s.etcd_auth
    if s.embedded_etcd_dir:
        # TLS with client certificates always, on the client and the peer port, on loopback too
        # (any local user could write a plan to etcd and have it run), with a CA of its own: the
        # cluster's CA also signs admin and viewer certificates, which etcd would take as writers.
        try:
            tls = await asyncio.to_thread(private_pki, os.path.join(s.embedded_etcd_dir, "pki"), "etcd", "127.0.0.1")
        except (OSError, ValueError, TlsError) as e:
            raise _bad("embedded_etcd_dir", f"cannot make its private CA in {s.embedded_etcd_dir}/pki: {e}") from None
        etcd_auth = EtcdAuth(tls[2], tls[0], tls[1], s.etcd_user, s.etcd_password)
        etcd = EmbeddedEtcd(s.embedded_etcd_dir, client_port=int(s.etcd_endpoint.rpartition(":")[2]), tls=tls).start()
        endpoint = etcd.endpoint
        log.info("embedded etcd %s (%s) on %s (TLS, client certificates required; data in %s)",
                 etcd_version() or "of unknown version", etcd_binary(), endpoint, s.embedded_etcd_dir)
    if s.metrics_listen:
        try:
            metrics.serve(s.metrics_listen)
        except OSError as e:
            raise SettingsError(f"metrics_listen: cannot listen on {s.metrics_listen}: {e.strerror}") from None
        log.info("metrics on http://%s/metrics", s.metrics_listen)
    store = Store(endpoint, Keys(s.namespace), auth=etcd_auth)
    etcd_versions = versions.VersionWatch(store, s.etcd_accept_version, embedded=etcd_version() if etcd else "")
    if refused := await etcd_versions.check():
        if etcd is not None:
            etcd.stop()
        raise SettingsError(refused[0])

    async def leader() -> str:
        try:
            kv = await store.get(store.keys.leader)
            return LeaderRecord.from_json(kv.value).node_id if kv else ""
        except (TemporaryError, PermanentError, MalformedRecord):
            return ""

    # Requests are small (a spec is bounded far below this); answers may be larger (events).
    server = grpc.aio.server(interceptors=[Authorizer(s.insecure, leader)],
                             options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                                      *liveness.SERVER_OPTIONS])
    local = _bind_socket(server, s)
    try:
        port = (server.add_secure_port(s.listen, s.tls.server_credentials()) if s.tls_cert
                else server.add_insecure_port(s.listen))
    except (RuntimeError, TlsError) as e:
        raise SettingsError(f"listen: cannot listen on {s.listen}: {e}") from None
    if port == 0:
        raise SettingsError(f"listen: cannot listen on {s.listen}")
    address = f"{s.advertise_host}:{port}"
    agent = NodeAgent(store, AgentConfig(node_id=s.node_id, host=s.advertise_host, agent_address=address,
                                         slots=s.slots, work_dir=s.work_dir, lease_ttl_s=s.lease_ttl_s, tls=s.tls,
                                         worker_user=worker, allow_env=s.allowed_env, pass_env=_names(s.pass_env),
                                         warm_standbys=s.warm_standbys, batch_scheduling=s.batch_scheduling,
                                         snapshot_root=snapshot_root(s), shutdown_grace_s=s.shutdown_grace_s))
    coordinator = Coordinator(store, CoordinatorConfig(
        node_id=s.node_id, control_address=address, lease_ttl_s=s.lease_ttl_s,
        reconcile_interval_s=s.reconcile_interval_s, ports=PortRange(s.master_port_start, s.master_port_span),
        tls=s.tls, progress_interval_s=s.progress_interval_s, keep_events=s.keep_events, keep_events_s=s.keep_events_s,
        keep_report_generations=s.keep_report_generations, local_socket=local, peer_evidence=s.peer_evidence))
    pb_grpc.add_AgentServicer_to_server(AgentService(agent), server)
    # The Control service answers operators: a short retry budget, so that an etcd outage is
    # reported as such (UNAVAILABLE, "etcd unavailable") before elasticctl's own deadline.
    control_store = Store(endpoint, Keys(s.namespace), retry=RetryPolicy(attempts=3, budget_s=2.0), auth=etcd_auth)
    pb_grpc.add_ControlServicer_to_server(ControlService(control_store, coordinator, s.allowed_env,
                                                         etcd_versions.members), server)
    await server.start()
    _share_socket(s, worker)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("elasticd %s serving on %s%s and %s, etcd %s; workers run as %s (uid %d)", s.node_id, address,
             " (TLS)" if s.tls_cert else "", local, endpoint, worker.name, worker.uid)

    refusal: list[str] = []

    async def recheck_versions() -> None:
        """The members' versions again after each (re)connection: an etcd replaced meanwhile."""
        if refused := await etcd_versions.check():
            refusal.extend(refused)
            stop.set()

    def registered() -> None:
        log.info("registered; ready")
        notify.ready(f"registered as {s.node_id}, serving on {address}")
        checks.add(task := asyncio.create_task(recheck_versions(), name="etcd-versions"))
        task.add_done_callback(checks.discard)

    checks: set[asyncio.Task[None]] = set()

    tasks = [asyncio.create_task(agent.run(stop, registered), name="agent"),
             asyncio.create_task(coordinator.run(stop), name="coordinator"),
             asyncio.create_task(notify.watchdog(stop, fencing.watchdog_s(s.lease_ttl_s)), name="watchdog")]
    try:
        done, _ = await asyncio.wait([*tasks, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t in tasks and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        stop.set()
        notify.stopping()
        log.info("shutting down: stopping local workers (grace %.0fs)", s.shutdown_grace_s)
        await agent.stop_all(s.shutdown_grace_s)
        await agent.standbys.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(1)
        await asyncio.gather(*checks, return_exceptions=True)
        await store.close()
        await control_store.close()
        if etcd is not None:
            etcd.stop()
    if refusal:
        raise SettingsError(refusal[0])


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_args(argv)
    except SettingsError as e:
        print(f"elasticd: {e}", file=sys.stderr)
        return 2
    logs.setup(settings.node_id, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except (SettingsError, NodeIdTaken) as e:
        print(f"elasticd: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
