"""Prometheus metrics of one elasticd (prometheus-client), served on ``metrics_listen``.

The leader sets the job-level ones (generations, restarts, recovery latency, world size,
step and step rate); every node sets its agent's (failure detection latency) and its
own health (leadership, etcd and gRPC errors). Label values are bounded: job names,
a fixed set of reasons, gRPC method names and etcd error kinds.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from mselastic.core.kinds import RelaunchReason

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
STEP_RATE = Gauge("mselastic_step_rate", "Optimizer steps per second of the job, over the last reports", ["job"])
LEADER = Gauge("mselastic_leader", "1 while this elasticd is the leader")
DEVICES = Gauge("mselastic_devices", "A node's devices by state (in_use, free, unhealthy), as the leader sees them",
                ["node", "state"])
ETCD_ERRORS = Counter("mselastic_etcd_errors", "etcd calls that failed, by kind", ["kind"])
GRPC_ERRORS = Counter("mselastic_grpc_errors", "gRPC calls to other elasticds that failed, by method", ["method"])
FORGED_BEATS = Counter("mselastic_forged_heartbeats", "Heartbeats dropped: not sent by a process of the generation")
JOB_ERRORS = Counter("mselastic_job_errors", "Reconcile passes of the job that raised (retried with backoff)", ["job"])


def forget_job(job: str) -> None:
    """Drop every series of a deleted job."""
    for metric in (GENERATIONS, RESTARTS, JOB_ERRORS, RECOVERY, WORLD_SIZE, GENERATION, STEP, STEP_RATE):
        metric.remove_by_labels({"job": job})


def serve(listen: str) -> None:
    """Serve /metrics on ``host:port`` (a daemon thread of prometheus-client)."""
    host, _, port = listen.rpartition(":")
    start_http_server(int(port), addr=host)


def show_devices(counts: dict[str, dict[str, int]], shown: set[str]) -> set[str]:
    """Set :data:`DEVICES` to ``counts`` (by node, by state), and remove the series of the nodes in
    ``shown`` (those set before) that are gone; returns the nodes shown now."""
    for node_id, by_state in counts.items():
        for state, count in by_state.items():
            DEVICES.labels(node_id, state).set(count)
    for node_id in shown - set(counts):
        for state in ("in_use", "free", "unhealthy"):
            try:
                DEVICES.remove(node_id, state)
            except KeyError:
                pass
    return set(counts)
