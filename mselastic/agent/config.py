"""What a node's agent is started with (elasticd's settings for this node, resolved): see
:class:`mselastic.agent.node.NodeAgent`."""

from __future__ import annotations

import dataclasses

from mselastic.agent.containment.cgroups import Limits, Tree
from mselastic.agent.devices.health import DeviceCheck
from mselastic.agent.containment.users import WorkerUser
from mselastic.tls import TlsFiles


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    node_id: str
    host: str  # address this node trains on
    agent_address: str  # host:port of this node's Agent service
    slots: int
    work_dir: str
    lease_ttl_s: int
    #: Its accelerators (see mselastic.core.devices): their kind ("" none) and ids.
    device_kind: str = ""
    devices: tuple[int, ...] = ()
    report_interval_s: float = 1.0
    tls: TlsFiles = TlsFiles()
    #: Who the workers run as (None: as elasticd itself), and the env names jobs may set anyway.
    worker_user: WorkerUser | None = None
    allow_env: frozenset[str] = frozenset()
    #: elasticd's own variables the workers inherit besides the usual ones (names, or NAME* prefixes).
    pass_env: frozenset[str] = frozenset()
    #: Keep standby workers for the jobs running here (see mselastic.agent.standbys.pools).
    warm_standbys: bool = True
    #: The jobs' processes start under SCHED_BATCH (see mselastic.agent.generation.launch.spawn_as_worker).
    batch_scheduling: bool = True
    #: This node's folder in memory for the jobs' snapshots ("": none; see Generation).
    snapshot_root: str = ""
    #: The workers' grace on shutdown (elasticd's shutdown_grace_s): the registration is revoked
    #: once they are gone; SHUTDOWN_MARGIN_S past it, they are killed.
    shutdown_grace_s: float = 10.0
    #: This node's cgroups (None: none; see mselastic.agent.containment.cgroups) and a job's limits here where
    #: its spec sets none (also the most it may set).
    cgroups: Tree | None = None
    job_limits: Limits = Limits()
    #: The uids jobs run as, one each (elasticd's job_uids; None: they run as worker_user).
    job_uids: range | None = None
    #: elasticd's folder for the generations' heartbeat sockets ("": abstract names; see
    #: mselastic.agent.generation.beats).
    heartbeat_dir: str = ""
    #: elasticd's own folder for its generations' shim files (agent.generation.shim; "": beside the logs).
    shim_dir: str = ""
    #: Each log file of a generation is rotated past this many MiB (0: never; mselastic.agent.containment.logcap).
    max_log_mb: int = 1024
    #: How long a device a failed rank's log named stays aside (0: until uncordoned; see
    #: mselastic.agent.devices.health).
    device_cooldown_s: float = 1800.0
    #: How often the node's tools are asked again for its devices (one gone is set aside; 0: never).
    device_detect_interval_s: float = 30.0
    #: The check a device passes before a generation uses it (see mselastic.agent.devices.health).
    device_check: DeviceCheck = DeviceCheck()

