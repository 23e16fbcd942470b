"""The trainer contract: the environment the agent gives each worker, and the
heartbeat datagrams a worker sends back.

Shared by the agent (which sets and reads these) and the trainer library (which
reads and sends them); both import it, neither imports the other.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import signal
from typing import Any

ENV_JOB = "MSELASTIC_JOB"
ENV_GENERATION = "MSELASTIC_GENERATION"
ENV_RESTART_COUNT = "MSELASTIC_RESTART_COUNT"
ENV_NODE_ID = "MSELASTIC_NODE_ID"
ENV_CHECKPOINT_DIR = "MSELASTIC_CHECKPOINT_DIR"
ENV_CHECKPOINT_INTERVAL = "MSELASTIC_CHECKPOINT_INTERVAL_STEPS"
ENV_KEEP_CHECKPOINTS = "MSELASTIC_KEEP_CHECKPOINTS"
ENV_STOP_CHECK_INTERVAL = "MSELASTIC_STOP_CHECK_INTERVAL_STEPS"
ENV_TOTAL_STEPS = "MSELASTIC_TOTAL_STEPS"
ENV_GLOBAL_BATCH = "MSELASTIC_GLOBAL_BATCH_SIZE"
ENV_MICRO_BATCHES = "MSELASTIC_MICRO_BATCH_SIZES"  # comma-separated; empty: any
ENV_HEARTBEAT = "MSELASTIC_HEARTBEAT"  # unix datagram socket: a path, or an abstract name (no "/")
ENV_RUN_ID = "MSELASTIC_RUN_ID"  # marks every process of one generation on one node
#: A file holding the step at which every rank of the generation stops (a planned stop): written by
#: the agent before it sends the ranks SIGTERM, read by a rank once it got the signal.
ENV_STOP_FILE = "MSELASTIC_STOP_FILE"
#: A folder in memory (tmpfs) of this node, the job's own, where the ranks keep snapshots of the
#: training state between checkpoints (unset: none), and how often they take one (0: never).
ENV_SNAPSHOT_DIR = "MSELASTIC_SNAPSHOT_DIR"
ENV_SNAPSHOT_INTERVAL = "MSELASTIC_SNAPSHOT_INTERVAL_STEPS"
#: "1": the agent started the job's processes under SCHED_BATCH for MindSpore's start-up
#: (elasticd's ``batch_scheduling``); the trainer library runs ``init()`` on one core, then puts
#: a rank's threads back on all its cores under SCHED_OTHER: its steps run as under plain msrun.
ENV_BATCH_START = "MSELASTIC_BATCH_START"

#: Standby workers (mselastic.trainer.standby): what one prints once MindSpore is imported, and the
#: variable after its marker whose bytes its handover rewrites with the generation's variables (so
#: /proc/<pid>/environ of a warm rank reads like an msrun-started one's).
STANDBY_READY = "mselastic-standby-ready"
#: What a standby fork server says to its agent (``mselastic.trainer.standby``): this, a space,
#: then a JSON object on one line.
STANDBY_FORKS = "mselastic-standby-forks"
ENV_STANDBY_SLOT = "MSELASTIC_ENV_SLOT"
STANDBY_SLOT_BYTES = 4096
#: Where a standby fork server also writes how each process it forked ended (one JSON object a
#: line, ``{"exit": pid, "code": c}``): what a successor of elasticd reads of the warm ranks it
#: adopts, their parent being the server (see ``mselastic.trainer.standby.serve``).
ENV_STANDBY_EXITS = "MSELASTIC_STANDBY_EXITS"

#: Variables the agent sets for every worker; a job spec may not override them.
DAEMON_VARS = frozenset({
    ENV_JOB, ENV_GENERATION, ENV_RESTART_COUNT, ENV_NODE_ID, ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_INTERVAL,
    ENV_KEEP_CHECKPOINTS, ENV_STOP_CHECK_INTERVAL, ENV_TOTAL_STEPS, ENV_GLOBAL_BATCH, ENV_MICRO_BATCHES,
    ENV_HEARTBEAT, ENV_RUN_ID, ENV_STOP_FILE, ENV_STANDBY_SLOT, ENV_SNAPSHOT_DIR, ENV_SNAPSHOT_INTERVAL,
    ENV_BATCH_START, ENV_STANDBY_EXITS,
})

def default_sockets() -> list[str]:
    """Where elasticd's local socket is by default, in the order elasticctl looks: root's
    elasticd (a service) puts it in /run/mselastic; another user's in its runtime directory."""
    import os

    runtime = os.environ.get("XDG_RUNTIME_DIR")
    mine = os.path.join(runtime, "mselastic", "elasticd.sock") if runtime else os.path.expanduser(
        "~/.mselastic/elasticd.sock")
    return ["/run/mselastic/elasticd.sock"] + ([mine] if os.geteuid() != 0 else [])


#: In checkpoint_dir: the pointer to the newest complete manifest (``{"manifest": name}``); each
#: manifest is a JSON object with the ``step`` it was taken at (see mselastic.trainer.checkpoint).
LATEST_CHECKPOINT = "latest.json"

#: A beat's note is cut to this many characters (a fatal reason names checkpoints and paths).
NOTE_MAX = 2000


def stop_step_ahead(steps: list[int], steps_per_s: float, latency_s: float) -> int:
    """The step a planned stop names for ranks at ``steps``: one every rank is still short of
    when told, ``latency_s`` from now. The highest step, one more (a rank may be inside it), one
    for a rank a step ahead of those seen, and the steps made meanwhile. 0 (none) while a rank's
    step is unknown (-1: it has not said where it resumed) or there are no ranks."""
    if not steps or min(steps) < 0:
        return 0
    return max(steps) + 2 + math.ceil(max(steps_per_s, 0.0) * latency_s)


def encode_stop_step(step: int) -> bytes:
    """A stop file's content: the step, in decimal, and a newline."""
    return f"{step}\n".encode()


def decode_stop_step(data: bytes) -> int | None:
    """The step in a stop file; None for anything else (torn, empty, not a number)."""
    text = data.decode("ascii", "replace")
    if not text.endswith("\n") or not text[:-1].isdigit():
        return None
    return int(text[:-1])


#: Sent by the agent to a rank still inside MindSpore's ``init()`` once a local peer has returned
#: from it: MindSpore's CPU collective (mccl) exchanges the ranks' addresses through the scheduler
#: and a rank that finds a peer's address missing sleeps a hard-coded 3 s before asking again
#: (``CollectiveNode::SynchronizeAddresses``). Every rank but the last to get there paid it, on
#: every launch. A peer that returned has seen every address, so the wait is over: the signal
#: ends the sleep early (``sleep`` returns on a handled signal) and the rank asks again at once.
#: The trainer library handles it only around ``init()`` on CPU; elsewhere its default
#: disposition (ignore) makes it harmless.
NUDGE_SIGNAL = signal.SIGURG

#: A worker that checkpointed on SIGTERM and exited on purpose (EX_TEMPFAIL).
PLANNED_EXIT_CODE = 75
#: A worker that cannot go on and says why in a ``fatal`` beat first (EX_CONFIG): no checkpoint every
#: rank can load, the checkpoint directory full. Relaunching would meet the same: the job fails.
FATAL_EXIT_CODE = 78


class BeatKind(str, enum.Enum):
    """What a heartbeat datagram says (its ``kind`` field on the wire is the value)."""

    PHASE = "phase"  # a start-up phase reached (``note`` names it: one of Beat.PHASES)
    START = "start"  # resumed (``resumed_step``), before the first step
    STEP = "step"
    CHECKPOINT = "checkpoint"
    FINISHED = "finished"  # total_steps reached
    PLANNED_EXIT = "planned_exit"  # checkpointed on an agreed SIGTERM at ``step``, leaving with code 75
    FATAL = "fatal"  # cannot go on (``note`` says why), leaving with code 78: relaunching cannot help
    STOP_REQUESTED = "stop_requested"  # got a SIGTERM that came with no stop step (an operator's): asks for one
    #: Entering a section of its own (``note``: its name, e.g. "checkpoint", "eval"), or leaving it
    #: (``note`` empty): the agent learns how long each section takes (mselastic.agent.generation.learned).
    SECTION = "section"


@dataclasses.dataclass(frozen=True)
class Beat:
    """One heartbeat. ``kind``: phase (start-up: ``note`` names it, one of PHASES), start (after
    resume), step, checkpoint, finished, planned_exit, fatal (``note``: why), stop_requested,
    section (``note``: the section entered, empty when left)."""

    kind: str
    rank: int
    pid: int
    generation: int
    step: int
    loss: float = 0.0
    resumed_step: int = -1
    at: float = 0.0
    #: With ``start``: how the resume went when it was not plain (e.g. a corrupt checkpoint skipped).
    note: str = ""
    #: When it was sent on the node's monotonic clock (the agent times sections by it: a wall
    #: clock stepped by NTP is not a long step); 0 from a trainer older than that.
    mono: float = 0.0

    KINDS = tuple(k.value for k in BeatKind)
    #: Start-up phases a worker reports before its first step, in order: ``init`` (its script has
    #: imported MindSpore and calls ``init()``), ``joined`` (``init()`` returned: the cluster formed).
    #: A local rank left behind a phase its peers passed is hung (see the agent's supervisor).
    PHASES = ("init", "joined")

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Beat":
        """Raises ValueError on anything that is not a well-formed beat."""
        raw: Any = json.loads(data)
        if not isinstance(raw, dict) or raw.get("kind") not in cls.KINDS:
            raise ValueError("not a heartbeat")
        return cls(kind=BeatKind(raw["kind"]), rank=int(raw["rank"]), pid=int(raw["pid"]),
                   generation=int(raw["generation"]), step=int(raw["step"]), loss=float(raw.get("loss", 0.0)),
                   resumed_step=int(raw.get("resumed_step", -1)), at=float(raw.get("at", 0.0)),
                   note=str(raw.get("note", ""))[:NOTE_MAX], mono=float(raw.get("mono", 0.0)))


def socket_address(heartbeat: str) -> str:
    """What a rank sends its beats to, from ``ENV_HEARTBEAT``: a path as is, an abstract name with its NUL."""
    return heartbeat if heartbeat.startswith("/") else "\0" + heartbeat
