"""The elastic context a training script starts with.

``ElasticContext.init()`` must be the first thing a script does: msrun's
scheduler runs the same script up to ``init()`` and serves inside it, so
anything before it runs once more in the scheduler. It then reads the world
from MindSpore (``get_group_size()`` / ``get_rank()``; never ``device_num`` from
the auto-parallel context, which reads back 1) and the job from the daemon's
``MSELASTIC_*`` variables, and sets up heartbeats and the SIGTERM handshake.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from typing import NoReturn

from mselastic.core import contract
from mselastic.core.contract import Beat
from mselastic.core.pdeathsig import die_with_parent
from mselastic.trainer.faults import FaultPlan

log = logging.getLogger("mselastic.trainer")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"mselastic: {name}={value!r} is not an integer") from None


@dataclasses.dataclass
class ElasticContext:
    rank: int
    device_num: int
    job: str
    generation: int
    restart_count: int
    checkpoint_dir: str
    checkpoint_interval_steps: int
    keep_checkpoints: int
    total_steps: int
    global_batch_size: int
    heartbeat_address: str = ""
    stop_requested: bool = False
    fault: FaultPlan | None = None
    _sock: socket.socket | None = None

    @classmethod
    def init(cls, checkpoint_dir: str = "", total_steps: int = 0, global_batch_size: int = 0) -> "ElasticContext":
        """Join the job: ``mindspore.communication.init()`` first, then everything else.

        The arguments are defaults for running the script without elasticd (plain msrun).
        """
        if os.environ.get(contract.ENV_RUN_ID):
            die_with_parent()
        from mindspore.communication import get_group_size, get_rank, init

        init()
        ctx = cls(
            rank=get_rank(), device_num=get_group_size(),
            job=os.environ.get(contract.ENV_JOB, "local"),
            generation=_env_int(contract.ENV_GENERATION, 0),
            restart_count=_env_int(contract.ENV_RESTART_COUNT, 0),
            checkpoint_dir=os.environ.get(contract.ENV_CHECKPOINT_DIR, checkpoint_dir),
            checkpoint_interval_steps=_env_int(contract.ENV_CHECKPOINT_INTERVAL, 10),
            keep_checkpoints=_env_int(contract.ENV_KEEP_CHECKPOINTS, 3),
            total_steps=_env_int(contract.ENV_TOTAL_STEPS, total_steps),
            global_batch_size=_env_int(contract.ENV_GLOBAL_BATCH, global_batch_size),
            heartbeat_address=os.environ.get(contract.ENV_HEARTBEAT, ""),
            fault=FaultPlan.from_env(),
        )
        if ctx.global_batch_size % ctx.device_num:
            raise SystemExit(f"mselastic: global batch {ctx.global_batch_size} is not divisible by "
                             f"world size {ctx.device_num}")
        if ctx.heartbeat_address:
            ctx._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            ctx._sock.setblocking(False)
        signal.signal(signal.SIGTERM, ctx._on_sigterm)
        return ctx

    # -- data parallel view --------------------------------------------------

    @property
    def shard_id(self) -> int:
        return self.rank

    @property
    def num_shards(self) -> int:
        return self.device_num

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch_size // self.device_num

    # -- heartbeats ----------------------------------------------------------

    def beat(self, kind: str, step: int, loss: float = 0.0, resumed_step: int = -1, note: str = "") -> None:
        """Tell the local agent we are alive (never blocks, never raises; an injected fault may fire)."""
        if self.fault is not None and kind == "step":
            self.fault.maybe_inject(self.rank, self.generation, step, self.checkpoint_dir)
        if self._sock is None:
            return
        b = Beat(kind=kind, rank=self.rank, pid=os.getpid(), generation=self.generation, step=step,
                 loss=float(loss), resumed_step=resumed_step, at=time.time(), note=note)
        try:
            self._sock.sendto(b.encode(), "\0" + self.heartbeat_address)
        except OSError:
            pass  # the agent is gone or busy; it will judge us by our process

    def started(self, resumed_step: int, note: str = "") -> None:
        """Tell the agent where this generation resumed (``note``: e.g. checkpoints skipped as corrupt)."""
        self.beat("start", resumed_step, resumed_step=resumed_step, note=note)

    def finished(self, step: int, loss: float) -> None:
        self.beat("finished", step, loss)

    # -- planned stop --------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def planned_exit(self, step: int) -> NoReturn:
        """After checkpointing on SIGTERM: leave with the planned-exit code."""
        self.beat("planned_exit", step)
        log.warning("rank %d: checkpointed at step %d on request; exiting", self.rank, step)
        sys.exit(contract.PLANNED_EXIT_CODE)
