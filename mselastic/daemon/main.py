"""elasticd: one per node. Agent for its node, candidate for coordinator, Control endpoint.

Example (a single machine, embedded etcd)::

    elasticd --node-id n0 --embedded-etcd-dir /var/lib/mselastic/etcd --slots 2

Example (a node of a cluster with an existing etcd)::

    elasticd --node-id gpu-07 --etcd-endpoint 10.0.0.2:2379 --listen 0.0.0.0:7070 \\
             --advertise-host 10.0.0.7 --slots 8

SIGTERM or SIGINT: local workers are asked to checkpoint (SIGTERM, grace
period), then killed; the node's registration is revoked; exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys

import grpc

from mselastic.agent.node import AgentConfig, NodeAgent
from mselastic.agent.service import AgentService
from mselastic.core.planner import PortRange
from mselastic.daemon import logs
from mselastic.daemon.control import ControlService
from mselastic.daemon.coordinator import Coordinator, CoordinatorConfig
from mselastic.store.embedded import EmbeddedEtcd
from mselastic.store.etcd import Store
from mselastic.store.keys import BadName, Keys, check_id
from mselastic.v1 import elastic_pb2_grpc as pb_grpc

log = logging.getLogger("elasticd")


class SettingsError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Settings:
    #: This node's id (etcd key name): letters, digits, '.', '_', '-'.
    node_id: str
    #: etcd client endpoint host:port, or several comma-separated (the members of a cluster);
    #: with embedded_etcd_dir, the single address the embedded member listens on.
    etcd_endpoint: str = "127.0.0.1:2379"
    #: Start a single-member etcd on loopback with its data here (a first run on one machine).
    embedded_etcd_dir: str = ""
    #: host:port the gRPC services (Agent, Control) listen on.
    listen: str = "127.0.0.1:7070"
    #: Address other nodes reach this one at; msrun's master_addr when this is node_rank 0.
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
    #: "text" or "json".
    log_format: str = "text"

    def validate(self) -> "Settings":
        try:
            check_id("node id", self.node_id)
            Keys(self.namespace)
            PortRange(self.master_port_start, self.master_port_span)
        except (BadName, ValueError) as e:
            raise SettingsError(str(e)) from None
        for name, value in [("etcd_endpoint", e) for e in self.etcd_endpoint.split(",")] + [("listen", self.listen)]:
            host, _, port = value.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise SettingsError(f"--{name.replace('_', '-')} {value!r} must be host:port")
        if self.embedded_etcd_dir and "," in self.etcd_endpoint:
            raise SettingsError("--embedded-etcd-dir runs one member: give --etcd-endpoint a single host:port")
        if self.slots < 0:
            raise SettingsError(f"--slots must be >= 0 (got {self.slots})")
        if self.lease_ttl_s < 2:
            raise SettingsError(f"--lease-ttl-s must be >= 2 (got {self.lease_ttl_s})")
        for name in ("reconcile_interval_s", "shutdown_grace_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"--{name.replace('_', '-')} must be > 0")
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"--log-format must be text or json (got {self.log_format!r})")
        return self


def parse_args(argv: list[str] | None = None) -> Settings:
    d = Settings(node_id="x")
    p = argparse.ArgumentParser(prog="elasticd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--node-id", default=socket.gethostname().split(".")[0], help="this node's id (default: hostname)")
    p.add_argument("--etcd-endpoint", default=d.etcd_endpoint, help="etcd host:port, or a comma-separated list of the cluster's members (default %(default)s)")
    p.add_argument("--embedded-etcd-dir", default="", help="run a single-member etcd on loopback, data in DIR")
    p.add_argument("--listen", default=d.listen, help="gRPC host:port for Agent and Control (default %(default)s)")
    p.add_argument("--advertise-host", default="", help="address peers use for this node (default: the listen host)")
    p.add_argument("--slots", type=int, default=d.slots, help="workers this node can run; 0: coordinate only (default %(default)s)")
    p.add_argument("--work-dir", default=d.work_dir, help="logs of each generation go here (default %(default)s)")
    p.add_argument("--namespace", default=d.namespace, help="etcd key prefix (default %(default)s)")
    p.add_argument("--lease-ttl-s", type=int, default=d.lease_ttl_s,
                   help="node and leader lease TTL in seconds (default %(default)s)")
    p.add_argument("--reconcile-interval-s", type=float, default=d.reconcile_interval_s,
                   help="leader reconcile period in seconds (default %(default)s)")
    p.add_argument("--shutdown-grace-s", type=float, default=d.shutdown_grace_s,
                   help="checkpoint grace for local workers on shutdown (default %(default)s)")
    p.add_argument("--master-port-start", type=int, default=d.master_port_start)
    p.add_argument("--master-port-span", type=int, default=d.master_port_span)
    p.add_argument("--log-format", default=d.log_format, choices=["text", "json"])
    a = p.parse_args(argv)
    host = a.listen.rpartition(":")[0]
    advertise = a.advertise_host or (host if host not in ("0.0.0.0", "::", "") else socket.gethostname())
    return Settings(node_id=a.node_id, etcd_endpoint=a.etcd_endpoint, embedded_etcd_dir=a.embedded_etcd_dir,
                    listen=a.listen, advertise_host=advertise, slots=a.slots, work_dir=os.path.abspath(a.work_dir),
                    namespace=a.namespace, lease_ttl_s=a.lease_ttl_s, reconcile_interval_s=a.reconcile_interval_s,
                    shutdown_grace_s=a.shutdown_grace_s, master_port_start=a.master_port_start,
                    master_port_span=a.master_port_span, log_format=a.log_format).validate()


async def serve(s: Settings) -> None:
    etcd = None
    endpoint = s.etcd_endpoint
    if s.embedded_etcd_dir:
        etcd = EmbeddedEtcd(s.embedded_etcd_dir, client_port=int(s.etcd_endpoint.rpartition(":")[2])).start()
        endpoint = etcd.endpoint
        log.info("embedded etcd on %s (data in %s)", endpoint, s.embedded_etcd_dir)
    store = Store(endpoint, Keys(s.namespace))
    server = grpc.aio.server()
    port = server.add_insecure_port(s.listen)
    if port == 0:
        raise SettingsError(f"cannot listen on {s.listen}")
    address = f"{s.advertise_host}:{port}"
    agent = NodeAgent(store, AgentConfig(node_id=s.node_id, host=s.advertise_host, agent_address=address,
                                         slots=s.slots, work_dir=s.work_dir, lease_ttl_s=s.lease_ttl_s))
    coordinator = Coordinator(store, CoordinatorConfig(
        node_id=s.node_id, control_address=address, lease_ttl_s=s.lease_ttl_s,
        reconcile_interval_s=s.reconcile_interval_s, ports=PortRange(s.master_port_start, s.master_port_span)))
    pb_grpc.add_AgentServicer_to_server(AgentService(agent), server)
    pb_grpc.add_ControlServicer_to_server(ControlService(store, coordinator), server)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("elasticd %s serving on %s, etcd %s", s.node_id, address, endpoint)
    tasks = [asyncio.create_task(agent.run(stop, lambda: log.info("registered; ready")), name="agent"),
             asyncio.create_task(coordinator.run(stop), name="coordinator")]
    try:
        done, _ = await asyncio.wait([*tasks, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t in tasks and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        stop.set()
        log.info("shutting down: stopping local workers (grace %.0fs)", s.shutdown_grace_s)
        await agent.stop_all(s.shutdown_grace_s)
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(1)
        await store.close()
        if etcd is not None:
            etcd.stop()


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_args(argv)
    except SettingsError as e:
        print(f"elasticd: {e}", file=sys.stderr)
        return 2
    logs.setup(settings.node_id, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except SettingsError as e:
        print(f"elasticd: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
