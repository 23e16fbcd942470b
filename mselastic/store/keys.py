"""The etcd key layout, in one place.

All keys live under a namespace (default ``/mselastic``)::

    <ns>/leader                               leased: who coordinates (LeaderRecord JSON)
    <ns>/nodes/<node_id>                      leased: NodeRecord JSON
    <ns>/cordons/<node_id>                    CordonRecord JSON (cordon / drain; survives re-registration)
    <ns>/cordons/<node_id>/devices/<device>   DeviceCordon JSON (one device set aside; likewise)
    <ns>/jobs/<job>/spec                      JobSpec JSON
    <ns>/jobs/<job>/plan                      Plan JSON (fenced writes only)
    <ns>/jobs/<job>/status                    JobStatus JSON (fenced writes only)
    <ns>/reports/<job>/<g:012d>/<node>        GenerationReport JSON, written by agents
    <ns>/plans/<job>/<g:012d>                 every committed plan, kept for the job's history
    <ns>/events/<job>/<seq:012d>              Event JSON, the job's timeline
    <ns>/deleted/<job>                        DeletedJob JSON: the last generation of a deleted job, so a
                                              job submitted again under its name continues the numbering
    <ns>/checkpoint_dirs/<sha256 of the path> the job that owns a checkpoint_dir (its name), claimed in the
                                              Submit transaction, released by delete

Reports, history and events grow with the job's life, so they live outside ``jobs/``:
the reconcile pass reads ``jobs/`` whole on every pass and must stay small; of the
reports it reads only the current and the previous generation's.

Names are checked so that no id can reach into another's keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class BadName(ValueError):
    pass


def check_id(kind: str, value: str) -> str:
    if not _ID.match(value):
        raise BadName(f"{kind} {value!r} must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return value


@dataclasses.dataclass(frozen=True)
class Keys:
    namespace: str = "/mselastic"

    def __post_init__(self) -> None:
        if not self.namespace.startswith("/") or self.namespace.endswith("/"):
            raise BadName(f"namespace {self.namespace!r} must start with '/' and not end with '/'")

    @property
    def leader(self) -> str:
        return f"{self.namespace}/leader"

    @property
    def nodes(self) -> str:
        return f"{self.namespace}/nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + check_id("node id", node_id)

    @property
    def cordons(self) -> str:
        return f"{self.namespace}/cordons/"

    def cordon(self, node_id: str) -> str:
        return self.cordons + check_id("node id", node_id)

    def device_cordons(self, node_id: str) -> str:
        """The prefix of one node's device cordons (ends in '/': never another node's, n10's for n1)."""
        return f"{self.cordon(node_id)}/devices/"

    def device_cordon(self, node_id: str, device: int) -> str:
        return f"{self.device_cordons(node_id)}{int(device)}"

    @property
    def jobs(self) -> str:
        return f"{self.namespace}/jobs/"

    def job(self, job: str) -> str:
        return self.jobs + check_id("job name", job) + "/"

    def spec(self, job: str) -> str:
        return self.job(job) + "spec"

    def plan(self, job: str) -> str:
        return self.job(job) + "plan"

    def job_uid(self, job: str) -> str:
        """The uid a job runs as (one of the leader's ``job_uids``; absent: the worker user)."""
        return self.job(job) + "uid"

    def uid_claim(self, uid: int) -> str:
        """Which job holds ``uid`` of ``job_uids`` (one job per uid, cluster-wide)."""
        return f"{self.uid_claims}{uid}"

    @property
    def uid_claims(self) -> str:
        return f"{self.namespace}/uids/"

    def plans(self, job: str) -> str:
        return f"{self.namespace}/plans/{check_id('job name', job)}/"

    def plan_history(self, job: str, generation: int) -> str:
        return f"{self.plans(job)}{generation:012d}"

    def status(self, job: str) -> str:
        return self.job(job) + "status"

    def events(self, job: str) -> str:
        return f"{self.namespace}/events/{check_id('job name', job)}/"

    def event(self, job: str, seq: int) -> str:
        return f"{self.events(job)}{seq:012d}"

    def checkpoint_dir(self, path: str) -> str:
        """Which job owns a checkpoint directory (``path`` normalized, hashed: a key for any path)."""
        digest = hashlib.sha256(os.path.normpath(path).encode()).hexdigest()[:32]
        return f"{self.namespace}/checkpoint_dirs/{digest}"

    def deleted(self, job: str) -> str:
        return f"{self.namespace}/deleted/{check_id('job name', job)}"

    @property
    def deleted_prefix(self) -> str:
        return f"{self.namespace}/deleted/"

    @property
    def all_reports(self) -> str:
        return f"{self.namespace}/reports/"

    def job_reports(self, job: str) -> str:
        return f"{self.all_reports}{check_id('job name', job)}/"

    def reports(self, job: str, generation: int) -> str:
        return f"{self.job_reports(job)}{generation:012d}/"

    def report(self, job: str, generation: int, node_id: str) -> str:
        return self.reports(job, generation) + check_id("node id", node_id)

    @staticmethod
    def range_end(prefix: str) -> str:
        """The first key after every key starting with ``prefix`` (keys are ASCII)."""
        return prefix[:-1] + chr(ord(prefix[-1]) + 1)

    def parse_report_key(self, key: str) -> tuple[str, int, str] | None:
        """``<ns>/reports/<job>/<g>/<node>`` -> (job, generation, node id); None for other keys."""
        parts = key[len(self.all_reports):].split("/") if key.startswith(self.all_reports) else []
        if len(parts) != 3 or not parts[1].isdigit() or not parts[0] or not parts[2]:
            return None
        return parts[0], int(parts[1]), parts[2]

    def parse_job_key(self, key: str) -> tuple[str, str] | None:
        """``<ns>/jobs/<job>/<rest>`` -> (job, rest); None for other keys."""
        if not key.startswith(self.jobs):
            return None
        job, _, rest = key[len(self.jobs):].partition("/")
        return (job, rest) if job and rest else None
