"""Faults as data, injected into a rank through the environment (for chaos tests and demos).

``MSELASTIC_FAULT="<kind>:rank=<r>:generation=<g>:step=<s>"`` makes rank ``r`` of
generation ``g`` (or of each generation in a range ``g1-g2``) fail at step ``s``
in the way ``kind`` says; several such plans, ``;``-separated, each fire on their own
(one fault per generation of one job). Nothing happens
without the variable; the job spec's ``env`` carries it to every generation, and
the generation filter makes the fault fire once.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import signal
import sys
import threading
import time

ENV_FAULT = "MSELASTIC_FAULT"


class Fault(enum.Enum):
    SIGKILL = "sigkill"  # killed from outside, no chance to react
    SIGTERM = "sigterm"  # asked to stop: checkpoints at the step boundary, exits with the planned code
    EXIT = "exit"  # exits with a non-zero code
    EXCEPTION = "exception"  # an uncaught Python exception
    ABORT = "abort"  # os.abort(): SIGABRT, as a crash in native code
    SIGSTOP = "sigstop"  # stops dead (a hang): no heartbeat until resumed
    #: Blocks for good in the step, on a lock nobody releases (a deadlock: asleep, not stopped; its
    #: peers wait for it in the next collective).
    HANG = "hang"
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # the newest checkpoint is damaged on disk, then SIGKILL
    #: Stuck before ``init()`` (a slow import, a blocked file system): sleeps and never reports a phase.
    #: Fires at start-up, so its ``step`` is ignored.
    STUCK_STARTUP = "stuck_startup"
    #: SIGKILL inside the checkpoint save of ``step`` (the parameters written, the manifest half
    #: written, nothing published): a torn save. Fires in the rank that saves (rank 0).
    SIGKILL_IN_SAVE = "sigkill_in_save"


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    fault: Fault
    rank: int
    generation: int
    step: int
    #: Last generation the fault fires in (a range from ``generation``).
    last_generation: int = 0

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        kind, *fields = text.split(":")
        try:
            values = dict(f.split("=", 1) for f in fields)
            first, _, last = values["generation"].partition("-")
            return cls(Fault(kind), int(values["rank"]), int(first), int(values["step"]), int(last or first))
        except (ValueError, KeyError) as e:
            raise ValueError(f"{ENV_FAULT}={text!r}: expected <kind>:rank=R:generation=G:step=S "
                             f"with kind one of {', '.join(f.value for f in Fault)} ({e})") from None

    def at_startup(self, rank: int, generation: int) -> None:
        """Before ``init()``: the start-up faults."""
        last = self.last_generation or self.generation
        if self.fault is Fault.STUCK_STARTUP and rank == self.rank and self.generation <= generation <= last:
            print(f"mselastic: injecting fault {self.fault.value} at rank {rank} generation {generation}",
                  file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def at_point(self, where: str, rank: int, generation: int, step: int) -> None:
        """A fault point inside the library (``where``: "save")."""
        last = self.last_generation or self.generation
        if (where == "save" and self.fault is Fault.SIGKILL_IN_SAVE and (rank, step) == (self.rank, self.step)
                and self.generation <= generation <= last):
            print(f"mselastic: injecting fault {self.fault.value} at rank {rank} generation {generation} step {step}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_inject(self, rank: int, generation: int, step: int, checkpoint_dir: str = "") -> None:
        last = self.last_generation or self.generation
        if (self.fault in (Fault.STUCK_STARTUP, Fault.SIGKILL_IN_SAVE) or (rank, step) != (self.rank, self.step)
                or not self.generation <= generation <= last):
            return
        print(f"mselastic: injecting fault {self.fault.value} at rank {rank} generation {generation} step {step}",
              file=sys.stderr, flush=True)
        if self.fault is Fault.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault is Fault.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.fault is Fault.EXIT:
            os._exit(3)
        elif self.fault is Fault.EXCEPTION:
            raise RuntimeError(f"injected fault at step {step}")
        elif self.fault is Fault.ABORT:
            os.abort()
        elif self.fault is Fault.SIGSTOP:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.fault is Fault.HANG:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # (held by itself: never returns)
        elif self.fault is Fault.CORRUPT_CHECKPOINT:
            _corrupt_newest(checkpoint_dir)
            os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Faults:
    """The plans of ``MSELASTIC_FAULT`` (``;``-separated), each firing on its own."""

    plans: tuple[FaultPlan, ...]

    @classmethod
    def parse(cls, text: str) -> "Faults":
        return cls(tuple(FaultPlan.parse(t.strip()) for t in text.split(";") if t.strip()))

    @classmethod
    def from_env(cls) -> "Faults | None":
        text = os.environ.get(ENV_FAULT, "")
        return cls.parse(text) if text else None

    def at_startup(self, rank: int, generation: int) -> None:
        for p in self.plans:
            p.at_startup(rank, generation)

    def at_point(self, where: str, rank: int, generation: int, step: int) -> None:
        for p in self.plans:
            p.at_point(where, rank, generation, step)

    def maybe_inject(self, rank: int, generation: int, step: int, checkpoint_dir: str = "") -> None:
        for p in self.plans:
            p.maybe_inject(rank, generation, step, checkpoint_dir)


def _corrupt_newest(checkpoint_dir: str) -> None:
    """Flip a byte in the middle of the checkpoint ``latest.json`` points to."""
    with open(os.path.join(checkpoint_dir, "latest.json")) as f:
        manifest = json.load(f)["manifest"]
    flip_byte(os.path.join(checkpoint_dir, manifest.replace(".json", ".ckpt")))


def flip_byte(path: str) -> None:
    """Damage a file the way a bad disk does: one byte in its middle inverted, on disk."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
