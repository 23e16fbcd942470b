from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RelaunchReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELAUNCH_REASON_UNSPECIFIED: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_INITIAL: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_RANK_FAILURE: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_HANG: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_MSRUN_FAILURE: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_NODE_LOST: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_SIGTERM: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_LAUNCH_ERROR: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_DRAIN: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_SCALE_UP: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_SCALE_DOWN: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_RESTART: _ClassVar[RelaunchReason]
    RELAUNCH_REASON_ELASTICD_RESTART: _ClassVar[RelaunchReason]

class FailureCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CAUSE_UNSPECIFIED: _ClassVar[FailureCause]
    FAILURE_CAUSE_RANK_EXITED: _ClassVar[FailureCause]
    FAILURE_CAUSE_RANK_HUNG: _ClassVar[FailureCause]
    FAILURE_CAUSE_RANK_NEVER_STARTED: _ClassVar[FailureCause]
    FAILURE_CAUSE_SIGTERM: _ClassVar[FailureCause]
    FAILURE_CAUSE_MSRUN_FAILED: _ClassVar[FailureCause]
    FAILURE_CAUSE_AGENT_RESTARTED: _ClassVar[FailureCause]
    FAILURE_CAUSE_SUPERVISOR_ERROR: _ClassVar[FailureCause]
    FAILURE_CAUSE_LAUNCH_SPEC: _ClassVar[FailureCause]
    FAILURE_CAUSE_LAUNCH_NODE: _ClassVar[FailureCause]
    FAILURE_CAUSE_NODE_LOST: _ClassVar[FailureCause]
    FAILURE_CAUSE_TRAINER_FATAL: _ClassVar[FailureCause]
    FAILURE_CAUSE_AGENT_SHUTDOWN: _ClassVar[FailureCause]
    FAILURE_CAUSE_DEVICE: _ClassVar[FailureCause]

class GenerationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GENERATION_STATE_UNSPECIFIED: _ClassVar[GenerationState]
    GENERATION_STATE_STARTING: _ClassVar[GenerationState]
    GENERATION_STATE_RUNNING: _ClassVar[GenerationState]
    GENERATION_STATE_SUCCEEDED: _ClassVar[GenerationState]
    GENERATION_STATE_FAILED: _ClassVar[GenerationState]
    GENERATION_STATE_STOPPED: _ClassVar[GenerationState]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RESTARTING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_STOPPED: _ClassVar[JobState]
RELAUNCH_REASON_UNSPECIFIED: RelaunchReason
RELAUNCH_REASON_INITIAL: RelaunchReason
RELAUNCH_REASON_RANK_FAILURE: RelaunchReason
RELAUNCH_REASON_HANG: RelaunchReason
RELAUNCH_REASON_MSRUN_FAILURE: RelaunchReason
RELAUNCH_REASON_NODE_LOST: RelaunchReason
RELAUNCH_REASON_SIGTERM: RelaunchReason
RELAUNCH_REASON_LAUNCH_ERROR: RelaunchReason
RELAUNCH_REASON_DRAIN: RelaunchReason
RELAUNCH_REASON_SCALE_UP: RelaunchReason
RELAUNCH_REASON_SCALE_DOWN: RelaunchReason
RELAUNCH_REASON_RESTART: RelaunchReason
RELAUNCH_REASON_ELASTICD_RESTART: RelaunchReason
FAILURE_CAUSE_UNSPECIFIED: FailureCause
FAILURE_CAUSE_RANK_EXITED: FailureCause
FAILURE_CAUSE_RANK_HUNG: FailureCause
FAILURE_CAUSE_RANK_NEVER_STARTED: FailureCause
FAILURE_CAUSE_SIGTERM: FailureCause
FAILURE_CAUSE_MSRUN_FAILED: FailureCause
FAILURE_CAUSE_AGENT_RESTARTED: FailureCause
FAILURE_CAUSE_SUPERVISOR_ERROR: FailureCause
FAILURE_CAUSE_LAUNCH_SPEC: FailureCause
FAILURE_CAUSE_LAUNCH_NODE: FailureCause
FAILURE_CAUSE_NODE_LOST: FailureCause
FAILURE_CAUSE_TRAINER_FATAL: FailureCause
FAILURE_CAUSE_AGENT_SHUTDOWN: FailureCause
FAILURE_CAUSE_DEVICE: FailureCause
GENERATION_STATE_UNSPECIFIED: GenerationState
GENERATION_STATE_STARTING: GenerationState
GENERATION_STATE_RUNNING: GenerationState
GENERATION_STATE_SUCCEEDED: GenerationState
GENERATION_STATE_FAILED: GenerationState
GENERATION_STATE_STOPPED: GenerationState
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RESTARTING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_STOPPED: JobState

class Member(_message.Message):
    __slots__ = ("node_id", "node_rank", "local_workers", "agent_address", "host", "devices", "device_kind", "lease_ttl_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_rank: int
    local_workers: int
    agent_address: str
    host: str
    devices: _containers.RepeatedScalarFieldContainer[int]
    device_kind: str
    lease_ttl_s: int
    def __init__(self, node_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., local_workers: _Optional[int] = ..., agent_address: _Optional[str] = ..., host: _Optional[str] = ..., devices: _Optional[_Iterable[int]] = ..., device_kind: _Optional[str] = ..., lease_ttl_s: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("job", "generation", "members", "world_size", "master_addr", "master_port", "restart_count", "reason", "planned", "kind", "stop_previous_at_step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STOP_PREVIOUS_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    reason: str
    planned: bool
    kind: RelaunchReason
    stop_previous_at_step: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., restart_count: _Optional[int] = ..., reason: _Optional[str] = ..., planned: _Optional[bool] = ..., kind: _Optional[_Union[RelaunchReason, str]] = ..., stop_previous_at_step: _Optional[int] = ...) -> None: ...

class LaunchRequest(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ...) -> None: ...

class LaunchResponse(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("job", "generation", "grace_period_s", "stop_at_step", "final")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GRACE_PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    grace_period_s: float
    stop_at_step: int
    final: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., grace_period_s: _Optional[float] = ..., stop_at_step: _Optional[int] = ..., final: _Optional[bool] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("leftover_pids",)
    LEFTOVER_PIDS_FIELD_NUMBER: _ClassVar[int]
    leftover_pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, leftover_pids: _Optional[_Iterable[int]] = ...) -> None: ...

class AgentStatusRequest(_message.Message):
    __slots__ = ("check_etcd_s",)
    CHECK_ETCD_S_FIELD_NUMBER: _ClassVar[int]
    check_etcd_s: float
    def __init__(self, check_etcd_s: _Optional[float] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "pid", "step", "loss", "finished")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    step: int
    loss: float
    finished: bool
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., finished: _Optional[bool] = ...) -> None: ...

class LocalGeneration(_message.Message):
    __slots__ = ("job", "generation", "state", "ranks", "failure", "steps_per_s", "warm", "adoptions")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    ADOPTIONS_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    state: GenerationState
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    failure: str
    steps_per_s: float
    warm: bool
    adoptions: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., state: _Optional[_Union[GenerationState, str]] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., failure: _Optional[str] = ..., steps_per_s: _Optional[float] = ..., warm: _Optional[bool] = ..., adoptions: _Optional[int] = ...) -> None: ...

class StandbyStatus(_message.Message):
    __slots__ = ("job", "pid", "ready")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    job: str
    pid: int
    ready: bool
    def __init__(self, job: _Optional[str] = ..., pid: _Optional[int] = ..., ready: _Optional[bool] = ...) -> None: ...

class AgentStatusResponse(_message.Message):
    __slots__ = ("node_id", "generations", "etcd_reachable", "standbys")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    ETCD_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    STANDBYS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    generations: _containers.RepeatedCompositeFieldContainer[LocalGeneration]
    etcd_reachable: bool
    standbys: _containers.RepeatedCompositeFieldContainer[StandbyStatus]
    def __init__(self, node_id: _Optional[str] = ..., generations: _Optional[_Iterable[_Union[LocalGeneration, _Mapping]]] = ..., etcd_reachable: _Optional[bool] = ..., standbys: _Optional[_Iterable[_Union[StandbyStatus, _Mapping]]] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("job", "rank", "generation", "follow", "tail_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    generation: int
    follow: bool
    tail_bytes: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., follow: _Optional[bool] = ..., tail_bytes: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("data", "generation")
    DATA_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    generation: int
    def __init__(self, data: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...

class NudgeRequest(_message.Message):
    __slots__ = ("job", "generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class NudgeResponse(_message.Message):
    __slots__ = ("running",)
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    running: bool
    def __init__(self, running: _Optional[bool] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("generation", "node_id", "rank", "reason", "detected_at", "recover_s", "cause")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    RECOVER_S_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    node_id: str
    rank: int
    reason: str
    detected_at: float
    recover_s: float
    cause: FailureCause
    def __init__(self, generation: _Optional[int] = ..., node_id: _Optional[str] = ..., rank: _Optional[int] = ..., reason: _Optional[str] = ..., detected_at: _Optional[float] = ..., recover_s: _Optional[float] = ..., cause: _Optional[_Union[FailureCause, str]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "agent_address", "slots", "version", "leader", "cordoned", "draining", "running_jobs", "used_slots", "device_kind", "devices", "lease_ttl_s", "adopted_jobs")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_JOBS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    agent_address: str
    slots: int
    version: str
    leader: bool
    cordoned: bool
    draining: bool
    running_jobs: _containers.RepeatedScalarFieldContainer[str]
    used_slots: int
    device_kind: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    lease_ttl_s: int
    adopted_jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., agent_address: _Optional[str] = ..., slots: _Optional[int] = ..., version: _Optional[str] = ..., leader: _Optional[bool] = ..., cordoned: _Optional[bool] = ..., draining: _Optional[bool] = ..., running_jobs: _Optional[_Iterable[str]] = ..., used_slots: _Optional[int] = ..., device_kind: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., lease_ttl_s: _Optional[int] = ..., adopted_jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("id", "job", "rank", "unhealthy", "unhealthy_since", "unhealthy_until")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_SINCE_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_UNTIL_FIELD_NUMBER: _ClassVar[int]
    id: int
    job: str
    rank: int
    unhealthy: str
    unhealthy_since: float
    unhealthy_until: float
    def __init__(self, id: _Optional[int] = ..., job: _Optional[str] = ..., rank: _Optional[int] = ..., unhealthy: _Optional[str] = ..., unhealthy_since: _Optional[float] = ..., unhealthy_until: _Optional[float] = ...) -> None: ...

class Quarantine(_message.Message):
    __slots__ = ("node_id", "failures", "until")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    failures: int
    until: float
    def __init__(self, node_id: _Optional[str] = ..., failures: _Optional[int] = ..., until: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "state", "generation", "world_size", "members", "restart_count", "step", "total_steps", "last_failure", "message", "quarantined", "note", "loss", "min_nodes", "max_nodes", "global_batch_size")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    job: str
    state: JobState
    generation: int
    world_size: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    restart_count: int
    step: int
    total_steps: int
    last_failure: Failure
    message: str
    quarantined: _containers.RepeatedCompositeFieldContainer[Quarantine]
    note: str
    loss: float
    min_nodes: int
    max_nodes: int
    global_batch_size: int
    def __init__(self, job: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., restart_count: _Optional[int] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., last_failure: _Optional[_Union[Failure, _Mapping]] = ..., message: _Optional[str] = ..., quarantined: _Optional[_Iterable[_Union[Quarantine, _Mapping]]] = ..., note: _Optional[str] = ..., loss: _Optional[float] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., global_batch_size: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class EtcdMember(_message.Message):
    __slots__ = ("endpoint", "version", "warning")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    version: str
    warning: str
    def __init__(self, endpoint: _Optional[str] = ..., version: _Optional[str] = ..., warning: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("jobs", "nodes", "leader", "etcd")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    ETCD_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    leader: str
    etcd: _containers.RepeatedCompositeFieldContainer[EtcdMember]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., leader: _Optional[str] = ..., etcd: _Optional[_Iterable[_Union[EtcdMember, _Mapping]]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("spec_json", "force")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    force: bool
    def __init__(self, spec_json: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("job", "warning")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    job: str
    warning: str
    def __init__(self, job: _Optional[str] = ..., warning: _Optional[str] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("job", "grace_period_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GRACE_PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    grace_period_s: float
    def __init__(self, job: _Optional[str] = ..., grace_period_s: _Optional[float] = ...) -> None: ...

class StopJobResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    def __init__(self, state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class CordonRequest(_message.Message):
    __slots__ = ("node_id", "cordon", "drain", "reason", "device", "remove")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CORDON_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cordon: bool
    drain: bool
    reason: str
    device: int
    remove: bool
    def __init__(self, node_id: _Optional[str] = ..., cordon: _Optional[bool] = ..., drain: _Optional[bool] = ..., reason: _Optional[str] = ..., device: _Optional[int] = ..., remove: _Optional[bool] = ...) -> None: ...

class CordonResponse(_message.Message):
    __slots__ = ("node_id", "cordoned", "draining", "removed")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cordoned: bool
    draining: bool
    removed: int
    def __init__(self, node_id: _Optional[str] = ..., cordoned: _Optional[bool] = ..., draining: _Optional[bool] = ..., removed: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("at", "kind", "generation", "message", "node_id", "rank", "detected_at", "step", "world_size", "loss")
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    at: float
    kind: str
    generation: int
    message: str
    node_id: str
    rank: int
    detected_at: float
    step: int
    world_size: int
    loss: float
    def __init__(self, at: _Optional[float] = ..., kind: _Optional[str] = ..., generation: _Optional[int] = ..., message: _Optional[str] = ..., node_id: _Optional[str] = ..., rank: _Optional[int] = ..., detected_at: _Optional[float] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class EventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("status", "spec_json", "plans")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    status: JobStatus
    spec_json: str
    plans: _containers.RepeatedCompositeFieldContainer[Plan]
    def __init__(self, status: _Optional[_Union[JobStatus, _Mapping]] = ..., spec_json: _Optional[str] = ..., plans: _Optional[_Iterable[_Union[Plan, _Mapping]]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class RestartRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class RestartResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("job", "min_nodes", "max_nodes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    job: str
    min_nodes: int
    max_nodes: int
    def __init__(self, job: _Optional[str] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("min_nodes", "max_nodes", "warning")
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    min_nodes: int
    max_nodes: int
    warning: str
    def __init__(self, min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., warning: _Optional[str] = ...) -> None: ...
