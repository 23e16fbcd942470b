"""The records kept in etcd: registered nodes, plans, agent reports, job status.

Each record is a frozen dataclass with a JSON codec. Decoding checks types and
raises :class:`MalformedRecord` (naming the key's kind and field) so a corrupt or
hand-edited etcd value is reported, never half-used.

Every record says the schema it was written in (``"schema"``: :data:`SCHEMA`). Fields added
later are ignored by an older reader and take their defaults in a newer one, so a change of that
kind keeps the schema; a change an older reader would misread (a field that changes meaning, a
record whose key moves) raises it, and a reader refuses a record of a schema above its own with
one line that says to upgrade (docs/DESIGN.md, "Records and upgrades"). A record without one was
written before schemas: 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, TypeVar

from mselastic.core.kinds import EventKind, RelaunchReason
from mselastic.core.states import FailureCause, GenerationState, JobState

T = TypeVar("T")

#: Reason on the reports a restarted elasticd closes: the generations its predecessor ran.
AGENT_RESTARTED = "elasticd restarted here; its workers ended with the previous one"  # (or were not adoptable)


#: The schema of the records this release writes, and the highest it reads.
SCHEMA = 1


class MalformedRecord(ValueError):
    """An etcd value that does not decode to the record it should hold."""


def _decode(cls: type[T], text: str | bytes) -> T:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise MalformedRecord(f"{cls.__name__}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise MalformedRecord(f"{cls.__name__}: expected an object")
    schema = data.pop("schema", 1)
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise MalformedRecord(f"{cls.__name__}: field 'schema' must be a positive int (got {schema!r:.80})")
    if schema > SCHEMA:
        raise MalformedRecord(f"{cls.__name__}: written in record schema {schema} by a newer mselastic; this one "
                              f"reads up to schema {SCHEMA}: upgrade mselastic on this node")
    return _from_dict(cls, data)


#: Field annotations whose values are checked when decoding (the others are converted by ``_convert``).
_SCALARS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_MAPS: dict[str, tuple[type, ...]] = {"dict[str, int]": (int,), "dict[str, float]": (int, float)}
_ABSENT = object()


@functools.lru_cache(maxsize=None)
def _checked_fields(cls: type) -> tuple[tuple[str, str, tuple[type, ...], bool], ...]:
    """(name, annotation, allowed types, is a map) of the fields _check_types checks: computed once
    per record class (a pass may decode thousands of records)."""
    return tuple((f.name, str(f.type), _SCALARS.get(str(f.type)) or _MAPS[str(f.type)], str(f.type) in _MAPS)
                 for f in dataclasses.fields(cls) if str(f.type) in _SCALARS or str(f.type) in _MAPS)


def _check_types(cls: type, data: dict[str, Any]) -> None:
    """A wrongly typed field is a malformed record: it must never reach the planner (where a
    comparison of a string with a number would raise in the middle of a reconcile pass)."""
    for name, kind, types, is_map in _checked_fields(cls):
        value = data.get(name, _ABSENT)
        if value is _ABSENT:
            continue
        if not is_map:
            ok = isinstance(value, types) and (kind == "bool" or value.__class__ is not bool)
        else:
            ok = isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, types) and v.__class__ is not bool for k, v in value.items())
        if not ok:
            raise MalformedRecord(f"{cls.__name__}: field {name!r} must be {kind} (got {value!r:.80})")


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _from_dict(cls: type[T], data: dict[str, Any]) -> T:
    hook = getattr(cls, "_convert", None)
    _check_types(cls, data)
    try:
        if hook is not None:
            data = hook(dict(data))
        names = _field_names(cls)  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})
    except (TypeError, ValueError, KeyError) as e:
        raise MalformedRecord(f"{cls.__name__}: {e}") from None


def _device_ids(value: Any) -> tuple[int, ...]:
    """A record's device ids: a list of distinct non-negative ints (ValueError otherwise)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in value) or len(set(value)) != len(value):
        raise ValueError(f"devices must be a list of distinct device ids (got {value!r:.80})")
    return tuple(value)


def _encode(record: Any) -> str:
    def default(o: Any) -> Any:
        if isinstance(o, (JobState, GenerationState, FailureCause, EventKind, RelaunchReason)):
            return o.value
        raise TypeError(type(o).__name__)

    return json.dumps({"schema": SCHEMA, **dataclasses.asdict(record)}, default=default, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """A live node, kept under ``nodes/<node_id>`` with the node's lease."""

    node_id: str
    agent_address: str  # host:port of its Agent gRPC service
    host: str  # address it trains on (master_addr when it is node_rank 0)
    slots: int  # workers it can run
    version: str
    #: etcd create revision of the registration: older nodes sort first.
    create_revision: int = 0
    #: Set from ``cordons/<node_id>`` when read (never written by the agent): no new generations here.
    cordoned: bool = False
    #: ... and running generations move off it (a planned relaunch without it).
    draining: bool = False
    #: Its accelerators (see mselastic.core.devices): their kind ("gpu", "ascend"; "" none) and
    #: the ids a plan may use; with devices, ``slots`` is their number.
    device_kind: str = ""
    devices: tuple[int, ...] = ()
    #: Its registration lease TTL (its own ``lease_ttl_s``): its fencing deadline follows it, not the
    #: leader's (a config rollout half done, a site's choice). 0: not said (a node of an earlier
    #: release): a leader counts its own.
    lease_ttl_s: int = 0

    @staticmethod
    def _convert(d: dict[str, Any]) -> dict[str, Any]:
        d["devices"] = _device_ids(d.get("devices", []))
        return d

    def to_json(self) -> str:
        return _encode(dataclasses.replace(self, create_revision=0, cordoned=False, draining=False))

    @classmethod
    def from_json(cls, text: str | bytes, create_revision: int = 0) -> "NodeRecord":
        rec = _decode(cls, text)
        return dataclasses.replace(rec, create_revision=create_revision)


@dataclasses.dataclass(frozen=True)
class Member:
    node_id: str
    node_rank: int
    local_workers: int
    agent_address: str
    host: str
    #: The device ids of its node its ranks use, local rank i on devices[i], and their kind (its
    #: node's); () and "" on a node without devices (see mselastic.core.devices).
    devices: tuple[int, ...] = ()
    device_kind: str = ""
    #: Its node's lease TTL when the plan was made (NodeRecord.lease_ttl_s; 0: not said): how long a
    #: leader waits for it to have fenced itself once its registration is gone.
    lease_ttl_s: int = 0

    @staticmethod
    def _convert(d: dict[str, Any]) -> dict[str, Any]:
        d["devices"] = _device_ids(d.get("devices", []))
        return d


@dataclasses.dataclass(frozen=True)
class Plan:
    """Generation ``generation`` of ``job``: who runs which ranks, and where to meet."""

    job: str
    generation: int
    members: tuple[Member, ...]
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    reason: str
    #: A relaunch the coordinator chose (drain, scale-up): ranks checkpoint on SIGTERM first.
    planned: bool = False
    #: Why it was committed (``reason`` says it in words).
    kind: RelaunchReason = RelaunchReason.INITIAL
    #: Planned: the step every rank of the previous generation stops at, chosen by the leader ahead
    #: of them all (0: none; an agent then chooses one for ranks that are all its own).
    stop_previous_at_step: int = 0

    @staticmethod
    def _convert(d: dict[str, Any]) -> dict[str, Any]:
        d["kind"] = RelaunchReason(d.get("kind", "initial"))
        if "world_size" not in d and isinstance(d.get("worker_num"), int):  # stored before the rename
            d["world_size"] = d.pop("worker_num")
        if not isinstance(d["members"], list) or not all(isinstance(m, dict) for m in d["members"]):
            raise ValueError("members must be a list of objects")
        d["members"] = tuple(_from_dict(Member, m) for m in d["members"])
        return d

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        return _decode(cls, text)

    @functools.cached_property
    def _by_node(self) -> dict[str, Member]:
        return {m.node_id: m for m in self.members}

    def member(self, node_id: str) -> Member | None:
        """O(1): the planner asks once per node, and a plan may have thousands of members."""
        return self._by_node.get(node_id)

    def member_of_rank(self, rank: int) -> Member | None:
        """The member that runs global ``rank`` (None when the plan has no such rank)."""
        first = 0
        for m in self.members:
            if first <= rank < first + m.local_workers:
                return m
            first += m.local_workers
        return None

    def first_rank(self, node_id: str) -> int:
        """Global rank of the node's first worker (ranks are contiguous per node)."""
        total = 0
        for m in self.members:
            if m.node_id == node_id:
                return total
            total += m.local_workers
        raise KeyError(node_id)


@dataclasses.dataclass(frozen=True)
class GenerationReport:
    """What an agent saw of one generation on its node (``reports/<job>/<g>/<node>``)."""

    job: str
    generation: int
    node_id: str
    state: GenerationState
    #: Global rank that failed first, -1 when none.
    failed_rank: int = -1
    reason: str = ""
    #: Wall-clock time (Unix seconds) the agent noticed the failure.
    detected_at: float = 0.0
    #: Wall-clock time every process of the generation was gone after a failure or stop.
    stopped_at: float = 0.0
    #: Wall-clock time the first rank of this generation reported a step.
    first_step_at: float = 0.0
    #: Step the generation resumed from (first heartbeat's resumed_step), -1 if unknown.
    resumed_step: int = -1
    #: How the resume went when not plain (a corrupt checkpoint skipped, ...).
    resume_note: str = ""
    #: Newest step any local rank reported.
    step: int = -1
    loss: float = 0.0
    #: Step every local rank checkpointed at before exiting on request (-1: not such an exit).
    exit_step: int = -1
    #: For FAILED / STOPPED: why, as a kind (``reason`` says it in words).
    cause: FailureCause = FailureCause.NONE
    #: Step each local rank resumed from (its ``start`` beat), by global rank: every rank of a
    #: generation must resume from the same checkpoint (the coordinator fails the job otherwise).
    resumed_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Started warm: standby workers were handed the generation (no msrun started).
    warm: bool = False
    #: The device ids of the node its ranks were launched on (its member's; () without devices):
    #: held until the generation is over here, whatever the newer plans say.
    devices: tuple[int, ...] = ()
    #: For a DEVICE failure: the device the failed rank's evidence named (-1: none).
    failed_device: int = -1
    #: How many times an elasticd took this generation over from an earlier one of its node (a
    #: restart or crash of elasticd; see agent.generation.adopt).
    adoptions: int = 0

    @staticmethod
    def _convert(d: dict[str, Any]) -> dict[str, Any]:
        d["state"] = GenerationState(d["state"])
        d["cause"] = FailureCause(d.get("cause", ""))
        d["devices"] = _device_ids(d.get("devices", []))
        return d

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "GenerationReport":
        return _decode(cls, text)


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    generation: int
    node_id: str
    rank: int
    reason: str
    #: When the agent noticed the failure (Unix seconds).
    detected_at: float
    #: Seconds from detection to the first step of the next generation (0 until known).
    recover_s: float = 0.0
    cause: FailureCause = FailureCause.NONE

    @staticmethod
    def _convert(d: dict[str, Any]) -> dict[str, Any]:
        d["cause"] = FailureCause(d.get("cause", ""))
        return d


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """``jobs/<job>/status``: the job's lifecycle, written only by the leader (fenced)."""

    state: JobState
    generation: int = 0
    restart_count: int = 0
    message: str = ""
    last_failure: FailureRecord | None = None
    updated_at: float = 0.0
    #: When the job started waiting for min_nodes (0 when it is not waiting).
    waiting_since: float = 0.0
    #: Failures blamed on each node so far.
    node_failures: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Quarantined nodes and when (Unix seconds) their cooldown ends.
    quarantined_until: dict[str, float] = dataclasses.field(default_factory=dict)
    #: The newest generation whose failure is already in node_failures (counted once).
    failures_counted_through: int = 0
    #: What the coordinator is waiting for or leaving out (scale-up pending, idle nodes, a drain that waits).
    note: str = ""
    #: Nodes that joined a running generation, and since when that set is unchanged (settle window).
    scale_up_nodes: tuple[str, ...] = ()
    scale_up_since: float = 0.0
    #: The newest planned generation whose resume is recorded in the events.
    resumed_through: int = 0
    #: ``elasticctl restart`` asked for a planned relaunch of this generation.
    restart_requested: int = 0
    #: STOPPED by an operator: the grace period the stop asked for (0: the spec's); the leader's
    #: reconcile pass stops the members with it.
    stop_grace_s: float = 0.0

    @staticmethod
    def _convert(d: dict[str, Any]) -> dict[str, Any]:
        d["state"] = JobState(d["state"])
        nodes = d.get("scale_up_nodes", [])
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise ValueError("scale_up_nodes must be a list of node ids")
        d["scale_up_nodes"] = tuple(nodes)
        if d.get("last_failure") is not None:
            if not isinstance(d["last_failure"], dict):
                raise ValueError("last_failure must be an object")
            d["last_failure"] = _from_dict(FailureRecord, d["last_failure"])
        return d

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "JobStatus":
        return _decode(cls, text)


@dataclasses.dataclass(frozen=True)
class Event:
    """One line of a job's timeline (``events/<job>/<seq>``)."""

    at: float
    kind: EventKind
    generation: int
    message: str
    node_id: str = ""
    rank: int = -1
    #: For a relaunch after a fault: when the fault was detected (Unix seconds).
    detected_at: float = 0.0
    #: For ``progress`` events: the step reached, the world size and the loss then.
    step: int = -1
    world_size: int = 0
    loss: float = 0.0

    @staticmethod
    def _convert(d: dict[str, Any]) -> dict[str, Any]:
        d["kind"] = EventKind(d["kind"])
        return d

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Event":
        return _decode(cls, text)


@dataclasses.dataclass(frozen=True)
class CordonRecord:
    """``cordons/<node_id>``: written by ``elasticctl cordon`` / ``drain``, removed by ``uncordon``."""

    node_id: str
    drain: bool
    at: float
    reason: str = ""

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "CordonRecord":
        return _decode(cls, text)


@dataclasses.dataclass(frozen=True)
class DeviceCordon:
    """``cordons/<node_id>/devices/<device>``: one device of a node set aside (issue #32), written by
    the node's agent when a rank's failure names its device, removed by ``elasticctl uncordon
    NODE --device N``; kept across re-registration, as a node's cordon is."""

    node_id: str
    device: int
    reason: str
    since: float
    #: When it may be given again (0: only once uncordoned).
    until: float = 0.0
    #: The job whose rank's failure or device check set it aside ("": the node's tools, an operator).
    job: str = ""

    def held(self, now: float) -> bool:
        return not self.until or self.until > now

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "DeviceCordon":
        return _decode(cls, text)


@dataclasses.dataclass(frozen=True)
class DeletedJob:
    """``deleted/<job>``: left by ``elasticctl delete``. Agents refuse a generation older than one
    they ran, so a job submitted again under the name starts after ``generation``."""

    generation: int
    at: float

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "DeletedJob":
        return _decode(cls, text)


@dataclasses.dataclass(frozen=True)
class LeaderRecord:
    """``leader``: which elasticd coordinates and where its Control service listens."""

    node_id: str
    control_address: str

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "LeaderRecord":
        return _decode(cls, text)
