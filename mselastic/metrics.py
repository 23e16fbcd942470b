"""Prometheus metrics of one elasticd (prometheus-client), served on ``metrics_listen``.

The leader sets the job-level ones (generations, restarts, recovery latency, world size,
step and step rate); every node sets its agent's (failure detection latency) and its
own health (leadership, etcd and gRPC errors). Label values are bounded: job names,
a fixed set of reasons, gRPC method names and etcd error kinds.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from mselastic.core.kinds import RelaunchReason
from mselastic.core.states import JobState

#: Restart/relaunch reasons used as the ``reason`` label.
REASONS = tuple(r.value for r in RelaunchReason)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)

GENERATIONS = Counter("mselastic_generations", "Generations committed by this elasticd as leader", ["job"])
RESTARTS = Counter("mselastic_restarts", "Relaunches by reason (planned ones included; not counted by max_restarts "
                   "when planned)", ["job", "reason"])
DETECTION = Histogram("mselastic_failure_detection_seconds",
                      "Seconds from a failed rank's last heartbeat to this agent's verdict", buckets=_LATENCY_BUCKETS)
RECOVERY = Histogram("mselastic_recovery_seconds",
                     "Seconds from a failure's detection to the next generation's first step", ["job"],
                     buckets=_LATENCY_BUCKETS)
WORLD_SIZE = Gauge("mselastic_world_size", "Ranks of the job's current generation", ["job"])
GENERATION = Gauge("mselastic_generation", "The job's current generation", ["job"])
STEP = Gauge("mselastic_step", "Newest step reported for the job", ["job"])
STEP_RATE = Gauge("mselastic_step_rate", "Optimizer steps per second of the job, over the last reports (0 after 30 s "
                  "without a step)", ["job"])
LEADER = Gauge("mselastic_leader", "1 while this elasticd is the leader")
DEVICES = Gauge("mselastic_devices", "A node's devices by state (in_use, free, unhealthy), as the leader sees them",
                ["node", "state"])
ETCD_ERRORS = Counter("mselastic_etcd_errors", "etcd calls that failed, by kind", ["kind"])
GRPC_ERRORS = Counter("mselastic_grpc_errors", "gRPC calls to other elasticds that failed, by method", ["method"])
FORGED_BEATS = Counter("mselastic_forged_heartbeats", "Heartbeats dropped: not sent by a process of the generation")
JOB_STATE = Gauge("mselastic_job_state", "1 for the job's current state, 0 for its other states (PENDING, RUNNING, "
                  "RESTARTING, SUCCEEDED, FAILED, STOPPED), as the leader sees it", ["job", "state"])
NODE_REGISTERED = Gauge("mselastic_node_registered", "1 while the node is registered (its elasticd runs and reaches "
                        "etcd); 0 while it is not and a job's current plan or a cordon still names it", ["node"])
JOB_ERRORS = Counter("mselastic_job_errors", "Reconcile passes of the job that raised (retried with backoff)", ["job"])


def forget_job(job: str) -> None:
    """Drop every series of a deleted job."""
    for metric in (GENERATIONS, RESTARTS, JOB_ERRORS, RECOVERY, WORLD_SIZE, GENERATION, STEP, STEP_RATE, JOB_STATE):
        metric.remove_by_labels({"job": job})


def serve(listen: str) -> None:
    """Serve /metrics on ``host:port`` (a daemon thread of prometheus-client)."""
    host, _, port = listen.rpartition(":")
    start_http_server(int(port), addr=host)


def not_leading() -> None:
    """Drop the job gauges this elasticd set as leader: the next leader's are the ones to read
    (a deposed leader's frozen step would look like a job that stopped training)."""
    for gauge in (WORLD_SIZE, GENERATION, STEP, STEP_RATE):
        gauge.clear()


def _show(gauge: Gauge, values: dict[tuple[str, ...], float], shown: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """Set ``gauge``'s series to ``values`` (by label values) and remove those in ``shown`` (set
    before) that are gone; returns the series shown now."""
    for labels, value in values.items():
        gauge.labels(*labels).set(value)
    for labels in shown - set(values):
        try:
            gauge.remove(*labels)
        except KeyError:
            pass
    return set(values)


#: The series the leader set (removed when what they name is gone, or when it stops leading).
Shown = dict[Gauge, set[tuple[str, ...]]]


def show_cluster(devices: dict[str, dict[str, int]], jobs: dict[str, JobState], nodes: dict[str, bool],
                 shown: Shown) -> Shown:
    """The leader's view of the cluster as gauges: each node's devices by state (in_use, free,
    unhealthy), each job's state, and which nodes are registered (``nodes``: those registered or
    still named by a plan or a cordon). All empty: what a node that stops leading shows."""
    return {
        DEVICES: _show(DEVICES, {(n, state): c for n, by in devices.items() for state, c in by.items()},
                       shown.get(DEVICES, set())),
        JOB_STATE: _show(JOB_STATE, {(job, st.value): float(st is state) for job, state in jobs.items()
                                     for st in JobState}, shown.get(JOB_STATE, set())),
        NODE_REGISTERED: _show(NODE_REGISTERED, {(n,): float(up) for n, up in nodes.items()},
                               shown.get(NODE_REGISTERED, set())),
    }
