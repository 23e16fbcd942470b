"""The elastic context a training script starts with.

``ElasticContext.init()`` must be the first thing a script does: msrun's
scheduler runs the same script up to ``init()`` and serves inside it, so
anything before it runs once more in the scheduler. It then reads the world
from MindSpore (``get_group_size()`` / ``get_rank()``; never ``device_num`` from
the auto-parallel context, which reads back 1) and the job from the daemon's
``MSELASTIC_*`` variables, and sets up heartbeats and the SIGTERM handshake.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator, NoReturn

from mselastic.core import contract
from mselastic.core.contract import NOTE_MAX, Beat, BeatKind
from mselastic.core.batching import BatchLayout, batch_layout
from mselastic.core.pdeathsig import die_with_parent
from mselastic.core.threads import each_thread
from mselastic.trainer.faults import Faults

log = logging.getLogger("mselastic.trainer")

#: How long a rank stays after its planned exit's barrier, for the barrier's last messages to leave
#: (see ``ElasticContext.planned_exit``).
EXIT_LINGER_S = 0.5


def _phase(name: str) -> None:
    """Report a start-up phase to the local agent, from a worker only (msrun's scheduler runs the
    script up to ``init()`` too). Best effort, like every beat."""
    address, rank = os.environ.get(contract.ENV_HEARTBEAT, ""), os.environ.get("RANK_ID", "")
    if not address or os.environ.get("MS_ROLE") != "MS_WORKER" or not rank.isdigit():
        return
    beat = Beat(kind=BeatKind.PHASE, rank=int(rank), pid=os.getpid(), generation=_env_int(contract.ENV_GENERATION, 0),
                step=-1, at=time.time(), note=name)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(beat.encode(), contract.socket_address(address))
    except OSError:
        pass


@contextlib.contextmanager
def _nudgeable() -> Iterator[None]:
    """Around ``init()`` on CPU: the agent's nudge (``NUDGE_SIGNAL``) ends MindSpore's 3 s sleep in
    the CPU collective's address exchange once a peer is through (see the signal's notes). A no-op
    handler is enough: the sleep returns when a handled signal arrives. Not on other backends (their
    own set-up never sleeps so, and an interrupted call there is not ours to risk), not off the main
    thread (Python takes signal handlers there only)."""
    import mindspore as ms

    if ms.get_context("device_target") != "CPU" or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(contract.NUDGE_SIGNAL, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(contract.NUDGE_SIGNAL, previous)


@contextlib.contextmanager
def _unraced() -> Iterator[None]:
    """Around ``init()`` when the agent started this process under SCHED_BATCH for it
    (``contract.ENV_BATCH_START``): on one core, so that MindSpore's TCP client, which hands a
    connection to its event loop's thread before it has finished setting it up, finishes first
    (SCHED_BATCH keeps the woken thread from preempting it, one core keeps it from running
    beside it: docs/journal/2026-12.md, "... SCHED_BATCH"). The threads ``init()`` starts inherit the core. Then
    every thread goes back to the process's cores and to SCHED_OTHER (threads started later
    inherit their starter's): training is scheduled as under plain msrun. Not msrun's scheduler: it
    connects to nobody, and serves inside ``init()`` until the job ends. Best effort."""
    if os.environ.get(contract.ENV_BATCH_START) != "1" or os.environ.get("MS_ROLE") != "MS_WORKER":
        yield
        return
    cores = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {sorted(cores)[_env_int("RANK_ID", 0) % len(cores)]})

    def release(tid: int) -> None:
        os.sched_setaffinity(tid, cores)
        if os.sched_getscheduler(tid) == os.SCHED_BATCH:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))

    try:
        yield
    finally:
        for tid, e in each_thread(release):
            log.warning("thread %d not released to its cores and SCHED_OTHER: %s", tid, e)


def joining(init: Callable[..., Any]) -> Callable[..., Any]:
    """``init`` (``mindspore.communication.init``) as elasticd's ranks call it: dying with their
    parent, an injected start-up fault first, the start-up phases reported around it, the
    agent's nudge handled inside it (see :func:`_nudgeable`), on one core and back (see
    :func:`_unraced`)."""
    @functools.wraps(init)
    def join(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get(contract.ENV_RUN_ID):
            die_with_parent()
        fault = Faults.from_env()
        if fault is not None and os.environ.get("MS_ROLE") == "MS_WORKER":
            fault.at_startup(_env_int("RANK_ID", -1), _env_int(contract.ENV_GENERATION, 0))
        _phase("init")
        with _nudgeable(), _unraced():
            result = init(*args, **kwargs)
        _phase("joined")
        return result

    join.__mselastic_joining__ = True  # type: ignore[attr-defined]
    return join


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"mselastic: {name}={value!r} is not an integer") from None


def _env_ints(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"mselastic: {name}={value!r} is not a comma-separated list of integers") from None


@dataclasses.dataclass
class ElasticContext:
    rank: int
    #: Ranks in this generation (``get_group_size()``); MindSpore's docs call it device_num.
    world_size: int
    job: str
    generation: int
    restart_count: int
    checkpoint_dir: str
    checkpoint_interval_steps: int
    keep_checkpoints: int
    total_steps: int
    global_batch_size: int
    layout: BatchLayout
    heartbeat_address: str = ""
    #: The backstop: at every multiple of this step the ranks agree (one allreduce) on a stop that
    #: came without a stop step (a SIGTERM from outside elasticd to a rank of a multi-node job).
    stop_check_interval_steps: int = 20
    #: Where the agent writes the step a planned stop happens at, before it sends SIGTERM.
    stop_file: str = ""
    #: Set by the SIGTERM handler (only there: the handler may run at any bytecode).
    stop_requested: bool = False
    #: The step every rank stops at, once read from ``stop_file``.
    stop_at: int | None = None
    #: This node's in-memory folder for snapshots between checkpoints ("": none), how often
    #: (steps; 0: never), and whether this rank keeps them (the first local rank of each node).
    snapshot_dir: str = ""
    snapshot_interval_steps: int = 0
    snapshot_keeper: bool = False
    fault: Faults | None = None
    _sock: socket.socket | None = None
    _sum: Any = None
    _overshot: bool = False
    #: The last step this rank said it completed (-1: none yet), for the beats that carry no step.
    _step: int = -1

    @classmethod
    def init(cls, checkpoint_dir: str = "", total_steps: int = 0, global_batch_size: int = 0,
             micro_batch_sizes: tuple[int, ...] = ()) -> "ElasticContext":
        """Join the job: ``mindspore.communication.init()`` first, then everything else.

        The arguments are defaults for running the script without elasticd (plain msrun).
        """
        from mindspore.communication import init

        joining(init)()
        return cls.current(checkpoint_dir, total_steps, global_batch_size, micro_batch_sizes)

    @classmethod
    def current(cls, checkpoint_dir: str = "", total_steps: int = 0, global_batch_size: int = 0,
                micro_batch_sizes: tuple[int, ...] = ()) -> "ElasticContext":
        """The context of a process that has joined already (``init()`` returned); the arguments
        are defaults for running without elasticd, as for :meth:`init`."""
        from mindspore.communication import get_group_size, get_rank

        world = get_group_size()
        gbs = _env_int(contract.ENV_GLOBAL_BATCH, global_batch_size)
        micro = _env_ints(contract.ENV_MICRO_BATCHES, micro_batch_sizes)
        layout = batch_layout(gbs, world, micro)
        if layout is None:
            raise SystemExit(f"mselastic: global batch {gbs} cannot be split over world size {world}"
                             + (f" with micro-batch sizes {list(micro)}" if micro else ""))
        ctx = cls(
            rank=get_rank(), world_size=world,
            job=os.environ.get(contract.ENV_JOB, "local"),
            generation=_env_int(contract.ENV_GENERATION, 0),
            restart_count=_env_int(contract.ENV_RESTART_COUNT, 0),
            checkpoint_dir=os.environ.get(contract.ENV_CHECKPOINT_DIR, checkpoint_dir),
            checkpoint_interval_steps=_env_int(contract.ENV_CHECKPOINT_INTERVAL, 10),
            keep_checkpoints=_env_int(contract.ENV_KEEP_CHECKPOINTS, 3),
            total_steps=_env_int(contract.ENV_TOTAL_STEPS, total_steps),
            global_batch_size=gbs, layout=layout,
            heartbeat_address=os.environ.get(contract.ENV_HEARTBEAT, ""),
            stop_check_interval_steps=max(1, _env_int(contract.ENV_STOP_CHECK_INTERVAL, 20)),
            stop_file=os.environ.get(contract.ENV_STOP_FILE, ""),
            snapshot_dir=os.environ.get(contract.ENV_SNAPSHOT_DIR, ""),
            snapshot_interval_steps=max(0, _env_int(contract.ENV_SNAPSHOT_INTERVAL, 0)),
            snapshot_keeper=os.environ.get("DEVICE_ID", "0") == "0",  # msrun's local index of the rank
            fault=Faults.from_env(),
        )
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
        return self.world_size

    @property
    def device_num(self) -> int:
        """MindSpore's name for :attr:`world_size` (kept for scripts that use it)."""
        return self.world_size

    @property
    def micro_batch(self) -> int:
        """Samples per forward/backward pass on this rank."""
        return self.layout.micro_batch

    @property
    def accumulation_steps(self) -> int:
        """Forward/backward passes per optimizer step (gradients summed, divided by this)."""
        return self.layout.accumulation_steps

    # -- heartbeats ----------------------------------------------------------

    def beat(self, kind: str, step: int, loss: float = 0.0, resumed_step: int = -1, note: str = "") -> None:
        """Tell the local agent we are alive (never blocks, never raises; an injected fault may fire)."""
        if self.fault is not None and kind == BeatKind.STEP:
            self.fault.maybe_inject(self.rank, self.generation, step, self.checkpoint_dir)
        if kind == BeatKind.STEP:
            self._step = step
        if self._sock is None:
            return
        b = Beat(kind=kind, rank=self.rank, pid=os.getpid(), generation=self.generation, step=step,
                 loss=float(loss), resumed_step=resumed_step, at=time.time(), note=note, mono=time.monotonic())
        try:
            self._sock.sendto(b.encode(), contract.socket_address(self.heartbeat_address))
        except OSError:
            pass  # the agent is gone or busy; it will judge us by our process

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A part of the run that is not a training step (an evaluation pass, a save of the
        script's own, a long wait for data), named for the agent::

            with ctx.section("eval"):
                accuracy = model.eval(test_set)

        Without a ``hang_timeout_s`` in the job's spec the agent learns how long each section
        takes (and steps, and first steps, apart from them) and calls a rank hung only when it
        is silent much longer than that section ever was: a section marked so is never judged
        by the steps' much shorter limit. Sections do not nest (the inner one's end ends both)."""
        name = name.strip()[:64] or "section"
        self.beat(BeatKind.SECTION, max(self._step, 0), note=name)
        try:
            yield
        finally:
            self.beat(BeatKind.SECTION, max(self._step, 0))

    def started(self, resumed_step: int, note: str = "") -> None:
        """Tell the agent where this generation resumed (``note``: e.g. checkpoints skipped as corrupt)."""
        self.beat(BeatKind.START, resumed_step, resumed_step=resumed_step, note=note)

    def finished(self, step: int, loss: float) -> None:
        self.beat(BeatKind.FINISHED, step, loss)

    # -- planned stop --------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def should_stop(self, step: int, previous: int | None = None) -> bool:
        """At the boundary after ``step``: do the ranks stop here? Every rank gets the same answer,
        so all checkpoint at the same step, wherever the SIGTERM landed.

        A planned stop costs nothing per step: elasticd chooses the step, ahead of every rank's,
        writes it to ``stop_file`` and then sends SIGTERM; a rank reads it once signalled and
        stops there. A SIGTERM that came without one (an operator's) is asked of the agent, which
        chooses one when all the ranks are its own, and the ranks agree anyway at every multiple
        of ``stop_check_interval_steps`` (one allreduce; the backstop for a multi-node job).

        ``previous``: the step of the boundary before (default ``step - 1``). Boundaries further
        apart (``Model.train`` in data sink mode calls back once per sink) stop at the first one at
        or past the named step, and agree at the first one past each multiple of the interval:
        every rank sees the same boundaries."""
        previous = step - 1 if previous is None else previous
        if self.stop_requested and self.stop_at is None:
            self.stop_at = self._read_stop_step()
            if self.stop_at is None:  # asked at every step until the agent answers (or the backstop)
                self.beat(BeatKind.STOP_REQUESTED, step)
        if self.stop_at is not None and previous >= self.stop_at and not self._overshot:
            # Too late to stop there with the others: they leave at it and the collective breaks;
            # the agent ends the generation and every rank resumes from one agreed checkpoint.
            self._overshot = True
            log.error("rank %d: read the stop step %d only after step %d; the others stop there without this rank",
                      self.rank, self.stop_at, step)
        named = self.stop_at is not None and previous < self.stop_at <= step
        k = self.stop_check_interval_steps
        if step // k == previous // k:
            return named
        # At a backstop step every rank is in the allreduce, a rank at its named step too (one that
        # has not read the step yet is there as well), and every signalled rank counts: all of
        # them leave here, or none. A SIGTERM that lands during the allreduce counts at the next.
        agreed = self.allreduce([1.0 if self.stop_requested else 0.0])[0] > 0
        return agreed or named

    def _read_stop_step(self) -> int | None:
        if not self.stop_file:
            return None
        try:
            with open(self.stop_file, "rb") as f:
                return contract.decode_stop_step(f.read(64))
        except OSError:
            return None

    def barrier(self) -> None:
        """Every rank waits here for the others (rank 0's checkpoint is committed after it)."""
        self.allreduce([0.0])

    def allreduce(self, values: list[float]) -> list[float]:
        """The element-wise sum over the ranks (MindSpore's CPU AllReduce sums float32 only: keep
        each value an integer below 2**24 to have it exact)."""
        import mindspore as ms
        import numpy as np
        from mindspore import ops

        if self.world_size == 1:
            return list(values)
        if self._sum is None:
            self._sum = ops.AllReduce(ops.ReduceOp.SUM)
        return [float(v) for v in self._sum(ms.Tensor(np.array(values, np.float32))).asnumpy()]

    def fatal(self, reason: str) -> NoReturn:
        """This rank cannot go on, and a relaunch would meet the same (no checkpoint every rank can
        load, the checkpoint directory full): say why to the agent, then leave with
        ``FATAL_EXIT_CODE``. The job fails with the reason instead of restarting for ever."""
        log.error("rank %d: %s", self.rank, reason)
        self.beat(BeatKind.FATAL, -1, note=reason[:NOTE_MAX])
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(contract.FATAL_EXIT_CODE)

    def planned_exit(self, step: int) -> NoReturn:
        """After checkpointing on an agreed stop: wait for the checkpoint, leave with the planned-exit code.

        msrun SIGKILLs the other workers as soon as one exits non-zero, so the ranks leave
        together: a barrier (rank 0's checkpoint is committed by then), then ``os._exit``
        soon after — MindSpore's own teardown at interpreter exit takes long enough for msrun
        to kill a slower rank, and there is nothing left to save. Not at once: a rank through
        the barrier may still have the barrier's last message to send (MindSpore sends from a thread
        of its own), and a peer whose data was lost with it waited in the barrier until killed
        (seen: rank 1 gone 50 ms after rank 0 reached the barrier, rank 0 killed 5 s later
        without having said it stopped). ``EXIT_LINGER_S`` gives those messages time to leave."""
        self.barrier()
        self.beat(BeatKind.PLANNED_EXIT, step)
        log.warning("rank %d: checkpointed at step %d on request; exiting", self.rank, step)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(EXIT_LINGER_S)
        os._exit(contract.PLANNED_EXIT_CODE)
