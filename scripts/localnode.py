"""One elasticd with an embedded etcd on this machine, for the demo and the benchmarks.

Everything the node starts (etcd, msrun, workers) inherits a marker in its
environment; :meth:`LocalNode.stop` stops elasticd by its process group and then
checks that no marked process is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Callable, Iterator, TypeVar

import grpc
import psutil
import tenacity

from mselastic.core import contract
from mselastic.core.contract import Beat
from mselastic.store.embedded import free_port
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

T = TypeVar("T")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
TRAIN = os.path.join(REPO, "examples", "lenet", "train.py")
MARK_VAR = "MSELASTIC_LOCAL_ID"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def wait_for(what: str, fn: Callable[[], T | None], timeout_s: float, poll_s: float = 0.05) -> T:
    """Poll ``fn`` until it returns something truthy; give up with ``what`` after ``timeout_s``."""
    try:
        return tenacity.Retrying(stop=tenacity.stop_after_delay(timeout_s), wait=tenacity.wait_fixed(poll_s),
                                 retry=tenacity.retry_if_result(lambda v: not v))(fn)  # type: ignore[return-value]
    except tenacity.RetryError:
        raise SystemExit(f"timed out after {timeout_s:.0f}s waiting for {what}") from None


@contextlib.contextmanager
def bench_folder(name: str) -> Iterator[str]:
    """A temporary folder for a benchmark's runs that elasticd's unprivileged workers may enter,
    removed on the way out."""
    root = tempfile.mkdtemp(prefix=f"mselastic-bench-{name}-")
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def write_lenet_spec(path: str, name: str, data: str, out_dir: str, ckpt_dir: str, steps: int,
                     max_restarts: int = 3, quarantine_after_failures: int = 3, args: tuple[str, ...] = (),
                     checkpoint_interval_steps: int = 10, more: str = "") -> str:
    """The spec, and its output and checkpoint folders made writable by the workers (they run as
    an unprivileged user: nobody here, unless the system has an mselastic user). ``args``: more
    of the script's; ``more``: more TOML lines."""
    for d in (out_dir, ckpt_dir):  # (the demo's own folders: the workers' user may write them)
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o1777)
    script_args = ["--data", os.path.abspath(data), "--out", out_dir, "--lr", "0.05", *args]
    with open(path, "w") as f:
        f.write(f'name = "{name}"\nscript = "{TRAIN}"\nargs = {json.dumps(script_args)}\n'
                f'workers_per_node = 2\ntotal_steps = {steps}\nglobal_batch_size = 32\n'
                f'checkpoint_dir = "{ckpt_dir}"\ncheckpoint_interval_steps = {checkpoint_interval_steps}\n'
                f'max_restarts = {max_restarts}\nquarantine_after_failures = {quarantine_after_failures}\n{more}')
    return path


class PlainMsrun:
    """A running plain-msrun LeNet job (no daemon) whose ranks' heartbeats this process receives."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, started: float) -> None:
        self.proc, self.sock, self.started = proc, sock, started

    def beat(self) -> Beat:
        """The next heartbeat of any rank (raises socket.timeout after 120 s without one)."""
        return Beat.decode(self.sock.recv(4096))


@contextlib.contextmanager
def plain_msrun(data: str, work: str, env: dict[str, str]) -> Iterator[PlainMsrun]:
    """LeNet under plain msrun, 2 workers, ``env`` added (the job's ``MSELASTIC_*`` settings);
    stopped with its whole process group on the way out."""
    name = f"mselastic-bench-{os.getpid()}-{time.time_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(120)
    full_env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
                    **{contract.ENV_HEARTBEAT: name, contract.ENV_CHECKPOINT_DIR: f"{work}/ckpt-{time.time_ns()}"})
    full_env.update(env)
    os.makedirs(work, exist_ok=True)
    cmd = [os.path.join(BIN, "msrun"), "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
           f"--log_dir={work}/logs", "--join=True", "--tail_worker_log=99999", TRAIN, "--data", data,
           "--out", f"{work}/out"]
    with open(f"{work}/msrun.log", "ab") as log:
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    try:
        yield PlainMsrun(proc, sock, started)
    finally:
        sock.close()
        if proc.poll() is None:
            # SIGINT makes msrun stop its workers and scheduler; then make sure of its group.
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class LocalNode:
    def __init__(self, work: str, node_id: str = "local-node") -> None:
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        self.work = work
        self.node_id = node_id
        self.etcd_endpoint = f"127.0.0.1:{free_port()}"
        self.endpoint = f"127.0.0.1:{free_port()}"
        #: The local socket: where elasticctl acts as admin (the TCP port, without a certificate, may only look).
        self.socket = os.path.join(work, "elasticd.sock")
        self.admin = "unix:" + self.socket
        self.mark = uuid.uuid4().hex
        self.env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), **{MARK_VAR: self.mark})
        self.daemon: subprocess.Popen[bytes] | None = None
        self.channel = grpc.insecure_channel(self.admin)
        self.control = pb_grpc.ControlStub(self.channel)
        self.agent = pb_grpc.AgentStub(self.channel)

    def start(self, *extra: str) -> "LocalNode":
        """Start elasticd (``extra``: more flags, e.g. ``--warm-standbys false``)."""
        # The workers run as an unprivileged user; where this machine's Python is out of that
        # user's reach (a pyenv in /root), the demo says so and runs them as root, out loud.
        from mselastic.agent.containment.users import UserError, cannot_run_python, resolve

        try:
            why = cannot_run_python(resolve(""))
        except UserError as e:
            why = str(e)
        user = ["--worker-user", "root"] if why else []
        if why:
            say(f"workers run as root here: {why} (on a node they run as an unprivileged user: docs/security.md)")
        with open(os.path.join(self.work, "elasticd.log"), "wb") as log:
            self.daemon = subprocess.Popen(
                [os.path.join(BIN, "elasticd"), "--config", os.devnull, "--namespace", "/mselastic",
                 "--metrics-listen", f"127.0.0.1:{free_port()}", "--node-id", self.node_id,
                 "--embedded-etcd-dir", os.path.join(self.work, "etcd"), "--etcd-endpoint", self.etcd_endpoint,
                 "--listen", self.endpoint, "--slots", "2", "--work-dir", os.path.join(self.work, "node"),
                 "--lease-ttl-s", "5", "--pass-env", MARK_VAR, "--socket", self.socket, *user, *extra],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        wait_for("elasticd to register and lead", self._leading, 60, 0.3)
        return self

    def _leading(self) -> bool:
        try:
            return self.control.Status(pb.StatusRequest(), timeout=5).leader == self.node_id
        except grpc.RpcError:
            return False

    def elasticctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([os.path.join(BIN, "elasticctl"), "--endpoint", self.admin, *args],
                              capture_output=True, text=True, env=self.env, timeout=120)

    def job(self, name: str) -> pb.JobStatus | None:
        try:
            res = self.control.Status(pb.StatusRequest(job=name), timeout=5)
        except grpc.RpcError:
            return None
        return res.jobs[0] if res.jobs else None

    def standbys(self, job: str) -> list[pb.StandbyStatus]:
        """The standby workers this node keeps for ``job`` (Agent service)."""
        return [s for s in self.agent.Status(pb.AgentStatusRequest(), timeout=5).standbys if s.job == job]

    def ranks(self, job: str) -> tuple[int, dict[int, pb.RankStatus]]:
        """The generation this node runs for ``job`` and its ranks (pid, step), from the Agent service."""
        res = self.agent.Status(pb.AgentStatusRequest(), timeout=5)
        for g in res.generations:
            if g.job == job:
                return g.generation, {r.rank: r for r in g.ranks}
        return 0, {}

    def etcdctl(self, *args: str) -> bytes:
        """etcdctl against the embedded etcd, with the client certificate elasticd made for it
        (it takes no client without one, see elasticd's embedded_etcd_dir)."""
        pki = os.path.join(self.work, "etcd", "pki")
        out = subprocess.run([os.path.join(BIN, "etcdctl"), f"--endpoints=https://{self.etcd_endpoint}",
                              f"--cacert={pki}/ca.pem", f"--cert={pki}/etcd.pem", f"--key={pki}/etcd-key.pem", *args],
                             capture_output=True, timeout=10)
        return out.stdout

    def etcd_get(self, key: str) -> bytes | None:
        return self.etcdctl("get", key, "--print-value-only").strip() or None

    def etcd_values(self, prefix: str) -> list[bytes]:
        return [line for line in self.etcdctl("get", prefix, "--prefix", "--print-value-only").splitlines()
                if line.strip()]

    def __enter__(self) -> "LocalNode":
        return self

    def __exit__(self, *exc: object) -> None:
        left = self.stop()
        if left:
            print(f"warning: killed leftover processes {left}", file=sys.stderr)

    def stop(self) -> list[int]:
        """Stop elasticd (SIGINT: it stops its workers and etcd; its SIGTERM would leave them to
        their shims); kill and return any marked leftovers."""
        if self.daemon is not None and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGINT)
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.daemon.pid, signal.SIGKILL)
                self.daemon.wait()
        self.channel.close()
        left = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(MARK_VAR) == self.mark and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        for proc in left:
            proc.kill()
        return [p.pid for p in left]
