"""A simulated cluster on one machine: one network namespace per node, on a bridge.

Each node is a network namespace with its own address (a veth pair whose root
end is attached to a bridge made for this cluster), running its own elasticd
through ``ip netns exec``. etcd listens on the bridge's address in the root
namespace, so every node reaches it and the test reads it directly. Only the
cluster's own addresses (10.213.<subnet>.0/24, chosen free) are used; no traffic
leaves the machine. A partition is a node's veth taken down.

Everything is torn down at the end, pass or fail: processes (through the test's
:class:`~tests.harness.Processes`), etcd, namespaces, veths and the bridge.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import signal
import subprocess
import uuid
from typing import Iterator

from mselastic.store.embedded import EmbeddedEtcd
from tests.harness import VENV_BIN, Etcd, Processes, elasticd_cmd, wait_for

AGENT_PORT = 7070


class ClusterFault(enum.Enum):
    """Faults of nodes, the coordinator and etcd, injected by the harness (rank faults are
    ``mselastic.trainer.faults.Fault``, injected through the environment)."""

    KILL_NODE = "kill_node"  # SIGKILL elasticd; its workers die with it
    PARTITION = "partition"  # the node's veth down
    HEAL = "heal"  # the node's veth up again
    JOIN = "join"  # a new node starts and registers
    KILL_LEADER = "kill_leader"  # SIGKILL the leading elasticd
    STOP_ETCD = "stop_etcd"  # stop the (first) etcd member; START_ETCD brings it back
    START_ETCD = "start_etcd"
    KILL_ETCD_LEADER = "kill_etcd_leader"  # SIGKILL the member leading the etcd cluster
    #: The node loses its route to etcd (a blackhole route in its namespace) but still reaches its
    #: peers; RECONNECT_ETCD removes the route.
    CUT_FROM_ETCD = "cut_from_etcd"
    RECONNECT_ETCD = "reconnect_etcd"
    #: SIGSTOP the (first) etcd member: what a stalled disk fsync or a long pause does. It keeps its
    #: connections but answers nothing; when it resumes, every lease it holds has expired at once.
    FREEZE_ETCD = "freeze_etcd"
    FREEZE_ETCD_LEADER = "freeze_etcd_leader"  # SIGSTOP the member leading the etcd cluster
    THAW_ETCD = "thaw_etcd"  # SIGCONT every frozen member
    #: A one-way cut: the node's packets reach etcd, etcd's answers do not reach the node (a
    #: blackhole route to it in etcd's namespace); RECONNECT_ETCD removes it as well.
    DEAF_TO_ETCD = "deaf_to_etcd"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


#: Held while a cluster picks its subnet and puts its bridge's address on it: clusters of tests side
#: by side (pytest-xdist workers, a bench beside the suite) never pick the same one.
SUBNET_LOCK = "/run/lock/mselastic-test-subnets.lock" if os.path.isdir("/run/lock") else "/tmp/mselastic-test-subnets.lock"


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    with open(SUBNET_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    for n in range(10, 250):
        if f"10.213.{n}." not in used:
            return n
    raise RuntimeError("no free 10.213.x.0/24 subnet for the test cluster")


class Cluster:
    def __init__(self, procs: Processes, tmp: str, namespace: str, lease_ttl_s: int = 3) -> None:
        self.procs = procs
        self.tmp = tmp
        self.namespace = namespace
        self.lease_ttl_s = lease_ttl_s
        #: Nodes started from now on keep standby workers (see tests.harness.elasticd_cmd).
        self.warm = False
        self.id = uuid.uuid4().hex[:4]
        self.subnet = 0  # (10.213.<subnet>.0/24, picked by up())
        self.bridge = f"msb{self.id}"
        self.nodes: dict[int, str] = {}  # index -> netns name
        self.daemons: dict[int, subprocess.Popen[bytes]] = {}
        self.etcd_server: EmbeddedEtcd | None = None  # the first member
        self.etcd_members: list[EmbeddedEtcd] = []
        self.etcd: Etcd | None = None
        self.frozen: list[EmbeddedEtcd] = []
        self.deaf: set[int] = set()  # nodes with a blackhole route to them in the root namespace

    # -- addresses and names ---------------------------------------------------

    @property
    def gateway(self) -> str:
        return f"10.213.{self.subnet}.1"

    def address(self, i: int) -> str:
        return f"10.213.{self.subnet}.{10 + i}"

    def veth(self, i: int) -> str:
        return f"msv{self.id}{i}"

    def node_id(self, i: int) -> str:
        return f"n{i}"

    def endpoint(self, i: int) -> str:
        return f"{self.address(i)}:{AGENT_PORT}"

    # -- lifecycle -------------------------------------------------------------

    @property
    def etcd_endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.etcd_members)

    def up(self, n_nodes: int, etcd_members: int = 1) -> "Cluster":
        _ip("link", "add", self.bridge, "type", "bridge")
        with _subnet_lock():  # (taken once the bridge has its address)
            self.subnet = _free_subnet()
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(n_nodes):
            ns = f"msn{self.id}{i}"
            _ip("netns", "add", ns)
            self.nodes[i] = ns
            _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(i), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        if etcd_members == 1:
            self.etcd_members = [EmbeddedEtcd(os.path.join(self.tmp, "etcd"), host=self.gateway)]
        else:
            members = [EmbeddedEtcd(os.path.join(self.tmp, f"etcd{k}"), host=self.gateway, name=f"e{k}")
                       for k in range(etcd_members)]
            initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
            self.etcd_members = [EmbeddedEtcd(m.data_dir, m.host, m.client_port, m.peer_port, m.name, initial)
                                 for m in members]
        for m in self.etcd_members:
            m.start(wait=False)
        for m in self.etcd_members:
            m.wait_ready()
        self.etcd_server = self.etcd_members[0]
        self.etcd = Etcd(self.etcd_endpoint, self.namespace)
        return self

    def etcd_leader(self) -> EmbeddedEtcd:
        """The member that currently leads the etcd cluster (asked through etcdctl)."""
        out = subprocess.run([os.path.join(VENV_BIN, "etcdctl"), f"--endpoints={self.etcd_endpoint}",
                              "endpoint", "status", "-w", "json"], capture_output=True, text=True, timeout=20,
                             check=True).stdout
        for entry in json.loads(out):
            if entry["Status"]["leader"] == entry["Status"]["header"]["member_id"]:
                return next(m for m in self.etcd_members if entry["Endpoint"].endswith(m.endpoint))
        raise AssertionError(f"no etcd leader in {out}")

    def start_node(self, i: int, slots: int = 1, extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        """``extra``: more elasticd arguments (they override the tests' defaults)."""
        assert self.etcd_server is not None
        cmd = elasticd_cmd(self.node_id(i), self.etcd_endpoint, AGENT_PORT,
                           os.path.join(self.tmp, f"node{i}"), self.namespace, slots=slots,
                           lease_ttl_s=self.lease_ttl_s, warm_standbys=self.warm)
        # A namespace's address is not loopback: plaintext there must be asked for (the bridge is
        # this test's own).
        cmd[cmd.index("--listen") + 1:cmd.index("--listen") + 2] = [self.endpoint(i), "--insecure", "true"]
        cmd += extra
        p = self.procs.start(f"elasticd-n{i}", ["ip", "netns", "exec", self.nodes[i], *cmd])
        self.daemons[i] = p
        return p

    def start_nodes(self, *indexes: int, slots: int = 1, extra: tuple[str, ...] = ()) -> None:
        """Start nodes one after the other, so registration (and so rank) order is index order."""
        for i in indexes:
            self.start_node(i, slots=slots, extra=extra)
            self.wait_registered(i)

    def wait_registered(self, *indexes: int, timeout_s: float = 30) -> None:
        assert self.etcd is not None
        etcd = self.etcd
        wait_for(f"nodes {indexes} registered",
                 lambda: all(etcd.get(etcd.keys.node(self.node_id(i))) for i in indexes), timeout_s, 0.1)

    def inject(self, fault: ClusterFault, node: int = -1) -> None:
        if fault is ClusterFault.KILL_NODE:
            self.kill_node(node)
        elif fault is ClusterFault.PARTITION:
            _ip("link", "set", self.veth(node), "down")
        elif fault is ClusterFault.HEAL:
            _ip("link", "set", self.veth(node), "up")
        elif fault is ClusterFault.JOIN:
            self.start_nodes(node)
        elif fault is ClusterFault.KILL_LEADER:
            assert self.etcd is not None
            leader = self.etcd.leader()
            assert leader is not None, "no leader to kill"
            self.kill_node(int(leader.removeprefix("n")))
        elif fault is ClusterFault.STOP_ETCD:
            self.etcd_members[0].stop()
        elif fault is ClusterFault.START_ETCD:
            self.etcd_members[0].start()
        elif fault is ClusterFault.KILL_ETCD_LEADER:
            self.etcd_leader().stop(signal.SIGKILL)
        elif fault in (ClusterFault.FREEZE_ETCD, ClusterFault.FREEZE_ETCD_LEADER):
            member = self.etcd_members[0] if fault is ClusterFault.FREEZE_ETCD else self.etcd_leader()
            assert member.proc is not None
            os.killpg(member.proc.pid, signal.SIGSTOP)
            self.frozen.append(member)
        elif fault is ClusterFault.THAW_ETCD:
            self.thaw()
        elif fault is ClusterFault.CUT_FROM_ETCD:  # etcd listens on the bridge's address only
            _ip("-n", self.nodes[node], "route", "add", "blackhole", f"{self.gateway}/32")
        elif fault is ClusterFault.RECONNECT_ETCD:
            if node in self.deaf:
                self.deaf.discard(node)
                _ip("route", "del", "blackhole", f"{self.address(node)}/32")
            else:
                _ip("-n", self.nodes[node], "route", "del", "blackhole", f"{self.gateway}/32")
        elif fault is ClusterFault.DEAF_TO_ETCD:  # (other nodes reach it over the bridge, not routed)
            _ip("route", "add", "blackhole", f"{self.address(node)}/32")
            self.deaf.add(node)

    def cut(self, i: int, j: int, heal: bool = False) -> None:
        """Nodes ``i`` and ``j`` stop reaching each other (a blackhole route each way); each still
        reaches etcd and the other nodes. ``heal``: the routes removed."""
        op = "del" if heal else "add"
        _ip("-n", self.nodes[i], "route", op, "blackhole", f"{self.address(j)}/32")
        _ip("-n", self.nodes[j], "route", op, "blackhole", f"{self.address(i)}/32")

    def thaw(self) -> None:
        for member in self.frozen:
            if member.proc is not None:
                os.killpg(member.proc.pid, signal.SIGCONT)
        self.frozen = []

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> int:
        """Signal the node's elasticd (SIGKILL: a crash, SIGTERM: a restart) and wait for its exit;
        its generations started cold train on under their shims (see agent.adopt). Its exit status."""
        os.kill(self.daemons[i].pid, sig)
        return self.daemons[i].wait(timeout=20)

    def down(self) -> None:
        """Stop everything; safe to call more than once and after a partial ``up``."""
        self.thaw()
        for i in list(self.deaf):
            subprocess.run(["ip", "route", "del", "blackhole", f"{self.address(i)}/32"], capture_output=True, timeout=30)
        self.deaf.clear()
        self.procs.stop_all()
        for m in self.etcd_members:
            m.stop()
        self.etcd_members = []
        self.etcd_server = None
        for i, ns in list(self.nodes.items()):
            subprocess.run(["ip", "link", "del", self.veth(i)], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            del self.nodes[i]
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
