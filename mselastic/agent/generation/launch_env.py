"""What a generation's processes are started with: their environment, msrun's command line and the
key a standby is matched by (pure: built from the plan, the spec and the node's settings).

The environment is built, not inherited: the daemon's own may hold what a job must not see (see
:mod:`mselastic.agent.containment.users`), and a job's ``env`` may not set loader or interpreter variables.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

from mselastic.agent.containment.cgroups import Group
from mselastic.agent.containment.users import WorkerUser, inherited_env
from mselastic.core import contract
from mselastic.core.devices import visible_env
from mselastic.core.model import Member, Plan
from mselastic.core.spec import JobSpec, forbidden_env

#: MindSpore's cluster heartbeat interval (seconds, drawn from [lower, upper]; its default is 3..5).
#: ``init()`` returns only at the first heartbeat after the cluster has formed, so the default
#: costs 3-5 s of every launch: measured (msrun, 2 ranks, median of 3) ``init()`` 5.4 s -> 2.1 s
#: and launch to first step 12.2 s -> 8.8 s at 1..1. Above 256 workers (MindSpore's own bound
#: for a large cluster) every worker's beat loads the one scheduler: its default is kept there.
FAST_HEARTBEAT_MAX_WORKERS = 256

#: What a standby gets only at its handover: the generation's own values (and HOME, the
#: generation's log folder for a switched user). Everything else of the generation's environment is
#: the job's, the same for every generation, and a standby starts with it.
PER_GENERATION_ENV = frozenset({
    contract.ENV_GENERATION, contract.ENV_RESTART_COUNT, contract.ENV_HEARTBEAT, contract.ENV_RUN_ID,
    contract.ENV_STOP_FILE, "HOME", "MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER"})


def mindspore_cluster_env(world_size: int) -> dict[str, str]:
    """What the agent sets of MindSpore's cluster settings for a generation of ``world_size``
    ranks (an admin's ``pass_env`` or a job's ``env`` that sets them wins)."""
    if world_size > FAST_HEARTBEAT_MAX_WORKERS:
        return {}
    return {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}


def heartbeat_socket(run_id: str, folder: str = "") -> str:
    """Where a generation's ranks send their beats: a socket in ``folder`` (elasticd's own, see
    :mod:`mselastic.agent.generation.beats`), named by a hash of the run id (a socket's path is short: 108
    bytes); without a folder, an abstract name."""
    if folder:
        return os.path.join(folder, hashlib.sha256(run_id.encode()).hexdigest()[:16])
    return "mselastic-hb-" + run_id


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Everything a generation's environment is made of on this node."""

    spec: JobSpec
    plan: Plan
    node_id: str
    log_dir: str
    stop_file: str
    run_id: str
    user: WorkerUser | None = None
    allow_env: frozenset[str] = frozenset()
    pass_env: frozenset[str] = frozenset()
    batch_scheduling: bool = True
    snapshot_dir: str = ""
    #: The job's cgroup on this node and the generation's (None: no cgroups here; see
    #: mselastic.agent.containment.cgroups): msrun starts in the generation's, a fork server in one of the job's.
    job_group: Group | None = None
    gen_group: Group | None = None
    #: Where the ranks send their beats (:func:`heartbeat_socket`; "": its abstract name).
    heartbeat: str = ""

    @property
    def switch(self) -> bool:
        """The workers run as a user of their own (the job's env then travels after the switch)."""
        return self.user is not None and self.user.switch

    @property
    def cwd(self) -> str:
        """msrun's and the ranks' working directory: the script's folder."""
        return os.path.dirname(self.spec.script)

    def job_env(self) -> dict[str, str]:
        """The job's env, without what it may not set (preflight refused a launch that sets any)."""
        refused = forbidden_env(dict(self.spec.env), self.allow_env)
        return {k: v for k, v in self.spec.env.items() if k not in refused}

    def env(self) -> dict[str, str]:
        """The generation's environment, as msrun and its ranks get it (a switched user's without
        the job's env: see :func:`mselastic.agent.generation.launch.spawn_as_worker`)."""
        env = inherited_env(os.environ, self.pass_env)
        if self.user is not None and self.switch:
            env.update(HOME=self.log_dir, USER=self.user.name, LOGNAME=self.user.name)
        else:
            env.update(self.job_env())
        venv_bin = os.path.dirname(sys.executable)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        env.update({
            contract.ENV_JOB: self.spec.name,
            contract.ENV_GENERATION: str(self.plan.generation),
            contract.ENV_RESTART_COUNT: str(self.plan.restart_count),
            contract.ENV_NODE_ID: self.node_id,
            contract.ENV_CHECKPOINT_DIR: self.spec.checkpoint_dir,
            contract.ENV_CHECKPOINT_INTERVAL: str(self.spec.checkpoint_interval_steps),
            contract.ENV_KEEP_CHECKPOINTS: str(self.spec.keep_checkpoints),
            contract.ENV_STOP_CHECK_INTERVAL: str(self.spec.stop_check_interval_steps),
            contract.ENV_TOTAL_STEPS: str(self.spec.total_steps),
            contract.ENV_GLOBAL_BATCH: str(self.spec.global_batch_size),
            contract.ENV_MICRO_BATCHES: ",".join(map(str, self.spec.micro_batch_sizes)),
            contract.ENV_HEARTBEAT: self.heartbeat or heartbeat_socket(self.run_id),
            contract.ENV_RUN_ID: self.run_id,
            contract.ENV_STOP_FILE: self.stop_file,
        })
        if self.batch_scheduling:
            env[contract.ENV_BATCH_START] = "1"
        if self.snapshot_dir:
            env[contract.ENV_SNAPSHOT_DIR] = self.snapshot_dir
            env[contract.ENV_SNAPSHOT_INTERVAL] = str(self.spec.snapshot_interval_steps)
        for name, value in mindspore_cluster_env(self.plan.world_size).items():
            env.setdefault(name, value)
        member = self.plan.member(self.node_id)
        if member is not None:  # (its devices, renumbered from 0: msrun's DEVICE_ID i is devices[i])
            env.update(visible_env(member.device_kind, member.devices))
        return env

    def standby_env(self, marker: str) -> dict[str, str]:
        """The environment a standby for this job starts with: the generation's without its own
        values (:data:`PER_GENERATION_ENV`: they come with the handover), its marker, and the slot
        the handover writes the generation's variables into (see ``mselastic.trainer.standby``).
        The marker and the slot stay last, and adjacent."""
        base = self.env()
        env = {k: v for k, v in base.items() if k not in PER_GENERATION_ENV}
        if "HOME" in base:  # (a switched user's: the job's log folder until its handover)
            env["HOME"] = os.path.dirname(self.log_dir)
        env[contract.ENV_STANDBY_EXITS] = self.standby_exits(marker)
        env[contract.ENV_RUN_ID] = marker
        env[contract.ENV_STANDBY_SLOT] = "x" * contract.STANDBY_SLOT_BYTES
        return env

    def standby_exits(self, marker: str) -> str:
        """Where the fork server started with ``marker`` records how the processes it forked ended
        (see ``mselastic.trainer.standby.serve``): the job's log folder, the worker user's."""
        return os.path.join(os.path.dirname(self.log_dir), f".standby-{marker.rpartition('.')[2]}.exits")

    def launch_key(self) -> str:
        """What a standby was started with that a generation could change: equal keys, equal starts."""
        env = {k: v for k, v in self.env().items() if k not in PER_GENERATION_ENV}
        what = [self.spec.script, list(self.spec.args), self.cwd, self.user.uid if self.user else os.geteuid(),
                sorted(env.items()), sorted(self.job_env().items())]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]

    def msrun_command(self, msrun: str, member: Member) -> list[str]:
        """The cold path's command: msrun starts the scheduler (on node_rank 0) and the local ranks."""
        p = self.plan
        return [msrun,
                f"--worker_num={p.world_size}", f"--local_worker_num={member.local_workers}",
                f"--master_addr={p.master_addr}", f"--master_port={p.master_port}",
                f"--node_rank={member.node_rank}", f"--log_dir={self.log_dir}",
                "--join=True", "--tail_worker_log=99999",
                f"--cluster_time_out={int(self.spec.startup_timeout_s)}",
                self.spec.script, *self.spec.args]

    def handover_env(self, sched_host: str) -> dict[str, str]:
        """What every process of a warm launch gets beside its role: msrun's environment
        (``process_entity/_api.py``: ``MS_WORKER_NUM``, ``MS_SCHED_HOST``, ``MS_SCHED_PORT``,
        ``MS_TOPO_TIMEOUT``, ``RANK_SIZE``), the job's env applied last, as msrun's is."""
        p = self.plan
        return {**self.env(), **self.job_env(),
                "MS_WORKER_NUM": str(p.world_size), "MS_SCHED_HOST": sched_host,
                "MS_SCHED_PORT": str(p.master_port), "MS_TOPO_TIMEOUT": str(int(self.spec.startup_timeout_s)),
                "RANK_SIZE": str(p.world_size)}
