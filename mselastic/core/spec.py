"""The job spec: what an operator submits, validated before anything is written.

A spec is a TOML file (``elasticctl submit job.toml``); on the wire and in etcd it
is the equivalent JSON object. Every field is documented here, has a unit in its
name where it has one, and a check: a bad spec is refused with one line naming
the field, so nothing half-valid ever reaches etcd.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tomllib
from typing import Any, Mapping

from mselastic.core.contract import DAEMON_VARS
from mselastic.core.batching import BatchLayout, batch_layout, node_count, valid_world_sizes

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def is_job_name(name: str) -> bool:
    """A name a job may have (lowercase letters, digits and '-', at most 63): never a path."""
    return bool(_NAME.match(name))

#: Upper bounds of the numeric fields (inclusive), documented in docs/user-guide.md. They keep every
#: computation on a spec small (the planner, the valid world sizes) and every value inside the
#: wire contract's int32/int64 and a float's exact integers.
INT32_MAX = 2**31 - 1
MAX_INTS: dict[str, int] = {
    "workers_per_node": 1024, "min_nodes": 100_000, "max_nodes": 100_000, "max_restarts": 1_000_000,
    "quarantine_after_failures": 1_000_000, "total_steps": 2**53, "global_batch_size": 2**31 - 1,
    "checkpoint_interval_steps": 2**53, "keep_checkpoints": 10_000, "stop_check_interval_steps": 1_000_000,
    "snapshot_interval_steps": 2**53, "memory_limit_mb": 2**40, "max_processes": 4194304,
}
#: Every duration is at most 30 days.
MAX_SECONDS = 30 * 24 * 3600.0
MAX_TEXT = 4096  # characters in one path, argument or environment value
MAX_ITEMS = 1024  # arguments, environment variables, micro-batch sizes


class SpecError(ValueError):
    """The spec is invalid; the message names the field and what to do."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    #: Job name: lowercase letters, digits and '-', at most 63 characters.
    name: str
    #: The training script msrun starts on every rank (absolute path).
    script: str
    #: Arguments passed to the script, as a list (never through a shell).
    args: tuple[str, ...] = ()
    #: MindSpore workers (ranks) each node runs.
    workers_per_node: int = 1
    #: Fewest nodes a generation may have; below it the job waits.
    min_nodes: int = 1
    #: Most nodes a generation may have.
    max_nodes: int = 1
    #: Relaunches allowed after failures before the job is FAILED.
    max_restarts: int = 3
    #: With fewer than min_nodes usable nodes for this long (before the first launch or
    #: after a failure), the job is FAILED instead of waiting forever.
    min_nodes_timeout_s: float = 600.0
    #: A node blamed for this many failures (a rank fault there, or its loss) is quarantined ...
    quarantine_after_failures: int = 3
    #: ... for this long, doubling with each further failure (at most an hour).
    quarantine_cooldown_s: float = 60.0
    #: Optimizer steps the job runs in total (the trainer stops there).
    total_steps: int = 100
    #: Samples per optimizer step over all ranks, kept constant across world sizes.
    global_batch_size: int = 32
    #: Micro-batch sizes a rank may run (gradient accumulation makes up the rest); empty:
    #: any, i.e. global_batch_size / world size with no accumulation. Only world sizes that
    #: reach global_batch_size exactly with one of them are used.
    micro_batch_sizes: tuple[int, ...] = ()
    #: A node that joins a running job is added after no other node joined for this long
    #: (several joins make one relaunch, at a checkpoint taken on request).
    scale_up_settle_s: float = 30.0
    #: Folder the trainer writes checkpoints to (absolute; shared by all nodes).
    checkpoint_dir: str = ""
    #: A checkpoint is written every this many steps.
    checkpoint_interval_steps: int = 10
    #: Checkpoints kept; older ones are deleted after a newer one is committed.
    keep_checkpoints: int = 3
    #: Between checkpoints, the first rank of every node keeps a copy of the training state in the
    #: node's memory every this many steps (0: never); after a crash the relaunch resumes from it
    #: when it is newer than the newest checkpoint. It costs a copy of the parameters to host memory
    #: on the training thread, and twice the checkpoint's size in memory on every node.
    snapshot_interval_steps: int = 1
    #: The backstop for a stop that comes without a stop step (a SIGTERM from outside elasticd to
    #: a rank of a multi-node job, elasticd itself stopped on one node of it): the ranks agree on it
    #: (one allreduce, a host sync) every this many steps (the agent waits that many steps, at the
    #: measured rate, on top of stop_grace_period_s; elasticd's shutdown_grace_s must cover them).
    #: elasticd's own planned stops (stop, drain, scale, restart, a single-node job's SIGTERM)
    #: name the step instead and cost nothing per step.
    stop_check_interval_steps: int = 20
    #: A rank with no heartbeat for this long is declared hung (a stopped one, state T: half as
    #: long). 0, the default: the agent learns the limits from the job itself, per section (steps,
    #: the first step, checkpoint saves, the script's named sections; see
    #: mselastic.agent.generation.learned): a stopped rank is found in a few typical steps, an
    #: idle silent one at 4x the longest that section took, and nothing is judged on a guess
    #: (60 s until a section is learned, startup_timeout_s for a first step).
    hang_timeout_s: float = 0.0
    #: A rank that has not sent its first heartbeat after this long is declared hung.
    startup_timeout_s: float = 180.0
    #: SIGTERM -> SIGKILL grace period when a generation is stopped; for a planned stop, on top of
    #: the time the ranks take to reach the step they stop at (at their measured step rate).
    stop_grace_period_s: float = 10.0
    #: Memory the job's processes may use on each node, in MiB (0: the node's job_memory_limit_mb,
    #: which is also the most a job gets). Past it the kernel's OOM killer ends one of them.
    memory_limit_mb: int = 0
    #: Processes and threads the job may have on each node (0: the node's job_max_processes, also
    #: the most); a fork past it fails. A MindSpore rank runs about a hundred threads.
    max_processes: int = 0
    #: Extra environment for the workers.
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def world_size_range(self) -> tuple[int, int]:
        return self.min_nodes * self.workers_per_node, self.max_nodes * self.workers_per_node

    def valid_world_sizes(self) -> list[int]:
        """World sizes in range that keep the global batch (see :mod:`mselastic.core.batching`)."""
        lo, hi = self.world_size_range
        return [w for w in valid_world_sizes(self.global_batch_size, lo, hi, self.micro_batch_sizes)
                if w % self.workers_per_node == 0]

    def layout(self, world_size: int) -> BatchLayout | None:
        return batch_layout(self.global_batch_size, world_size, self.micro_batch_sizes)

    def node_count(self, available: int) -> int:
        """Nodes to use out of ``available`` (the most with a valid world size); 0: none will do."""
        return node_count(available, self.min_nodes, self.max_nodes, self.workers_per_node,
                          self.global_batch_size, self.micro_batch_sizes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["args"] = list(self.args)
        d["micro_batch_sizes"] = list(self.micro_batch_sizes)
        d["env"] = dict(self.env)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "JobSpec":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise SpecError(f"spec is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> "JobSpec":
        if not isinstance(data, dict):
            raise SpecError("spec must be a table of fields (got %s)" % type(data).__name__)
        known = {f.name: f for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                near = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise SpecError(f"field {key!r:.80}: unknown field; {hint}known fields are {', '.join(sorted(known))}")
        for required in ("name", "script", "checkpoint_dir"):
            if required not in data or data[required] in ("", None):
                raise SpecError(f"field '{required}': required")
        values: dict[str, Any] = {}
        for key, value in data.items():
            values[key] = _coerce(key, known[key], value)
        spec = cls(**values)
        spec._validate()
        return spec

    def _validate(self) -> None:
        if not _NAME.match(self.name):
            _fail("name", f"{self.name!r} must be lowercase letters, digits and '-' (at most 63)")
        for key in ("script", "checkpoint_dir"):
            if not os.path.isabs(getattr(self, key)):
                _fail(key, f"{getattr(self, key)!r} must be an absolute path")
        for key in ("workers_per_node", "min_nodes", "max_nodes", "total_steps", "global_batch_size",
                    "checkpoint_interval_steps", "keep_checkpoints", "stop_check_interval_steps",
                    "quarantine_after_failures"):
            if getattr(self, key) <= 0:
                _fail(key, f"must be a positive integer (got {getattr(self, key)})")
        for key in ("max_restarts", "snapshot_interval_steps", "memory_limit_mb", "max_processes"):
            if getattr(self, key) < 0:
                _fail(key, f"must be >= 0 (got {getattr(self, key)})")
        if not self.hang_timeout_s >= 0:
            _fail("hang_timeout_s", f"must be 0 (learned from the job) or a positive number of seconds "
                                    f"(got {self.hang_timeout_s})")
        for key in ("startup_timeout_s", "stop_grace_period_s", "min_nodes_timeout_s",
                    "quarantine_cooldown_s", "scale_up_settle_s"):
            if not getattr(self, key) > 0:
                _fail(key, f"must be a positive number of seconds (got {getattr(self, key)})")
        if 0 < self.memory_limit_mb < 256:
            _fail("memory_limit_mb", f"must be 0 (the node's) or at least 256: a MindSpore rank alone takes more "
                                     f"(got {self.memory_limit_mb})")
        if 0 < self.max_processes < 64:
            _fail("max_processes", f"must be 0 (the node's) or at least 64: msrun, its scheduler and a rank run "
                                   f"dozens of threads (got {self.max_processes})")
        if self.min_nodes > self.max_nodes:
            _fail("min_nodes", f"must be <= max_nodes (got {self.min_nodes} > {self.max_nodes})")
        for key, top in MAX_INTS.items():
            if getattr(self, key) > top:
                _fail(key, f"must be at most {top} (got {getattr(self, key)})")
        for key in ("hang_timeout_s", "startup_timeout_s", "stop_grace_period_s", "min_nodes_timeout_s",
                    "quarantine_cooldown_s", "scale_up_settle_s"):
            if getattr(self, key) > MAX_SECONDS:
                _fail(key, f"must be at most {MAX_SECONDS:.0f} seconds (30 days; got {getattr(self, key)})")
        for key in ("args", "micro_batch_sizes", "env"):
            if len(getattr(self, key)) > MAX_ITEMS:
                _fail(key, f"at most {MAX_ITEMS} entries (got {len(getattr(self, key))})")
        texts = [("script", self.script), ("checkpoint_dir", self.checkpoint_dir),
                 *(("args", a) for a in self.args), *(("env", f"{k}={v}") for k, v in self.env.items())]
        for key, text in texts:
            if len(text) > MAX_TEXT or "\0" in text:
                _fail(key, f"values must be at most {MAX_TEXT} characters with no NUL byte")
        for m in self.micro_batch_sizes:
            if m <= 0 or m > INT32_MAX:
                _fail("micro_batch_sizes", f"must be integers in 1..{INT32_MAX} (got {m})")
        if not self.valid_world_sizes():
            lo, hi = self.world_size_range
            with_micro = f" with micro_batch_sizes {list(self.micro_batch_sizes)}" if self.micro_batch_sizes else ""
            _fail("global_batch_size", f"{self.global_batch_size} cannot be split over any world size in "
                                       f"{lo}..{hi} (min_nodes..max_nodes x workers_per_node){with_micro}; "
                                       f"change global_batch_size or the node range")
        for k, v in self.env.items():
            if not k or "=" in k:
                _fail("env", f"variable name {k!r} is not valid")
            if k in DAEMON_VARS:
                _fail("env", f"{k} is set by the daemon and cannot be overridden")


def load_toml(path: str) -> JobSpec:
    """Read a spec file; relative ``script`` / ``checkpoint_dir`` resolve against its folder."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise SpecError(f"cannot read spec file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"spec file {path} is not valid TOML: {e}") from None
    base = os.path.dirname(os.path.abspath(path))
    for key in ("script", "checkpoint_dir"):
        value = data.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            data[key] = os.path.normpath(os.path.join(base, value))
    return JobSpec.from_dict(data)


def _fail(field: str, message: str) -> None:
    raise SpecError(f"field '{field}': {message}")


def _coerce(key: str, field: dataclasses.Field[Any], value: Any) -> Any:
    kind = field.type
    if kind == "str":
        if not isinstance(value, str):
            _fail(key, f"must be a string (got {value!r})")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, f"must be an integer (got {value!r})")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, f"must be a number of seconds (got {value!r})")
        return float(value)
    if kind == "tuple[int, ...]":
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            _fail(key, "must be a list of integers")
        return tuple(value)
    if kind == "tuple[str, ...]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            _fail(key, "must be a list of strings")
        return tuple(value)
    if kind == "Mapping[str, str]":
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            _fail(key, "must be a table of string values")
        return dict(value)
    raise AssertionError(f"unhandled field type {kind} for {key}")


#: Names a job's env may not set unless the admin allows them: the dynamic loader's, the
#: interpreters' (PYTHONWARNINGS and PYTHONSTARTUP import modules, PYTHONPATH picks them), the
#: search path, and the shells' start-up files; and which devices a rank sees (the node's business:
#: see mselastic.core.devices).
FORBIDDEN_PREFIXES = ("LD_", "PYTHON", "PERL5", "RUBY")
FORBIDDEN = frozenset({"PATH", "BASH_ENV", "ENV", "IFS", "GCONV_PATH", "HOSTALIASES", "NODE_OPTIONS", "MALLOC_CONF",
                       "GLIBC_TUNABLES", "LOCPATH", "NLSPATH", "TZDIR", "RES_OPTIONS", "LOCALDOMAIN", "MALLOC_TRACE",
                       "GETCONF_DIR", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ASCEND_RT_VISIBLE_DEVICES",
                       "DEVICE_ID"})
#: Harmless interpreter variables a job may always set.
HARMLESS = frozenset({"PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE"})


def forbidden_env(env: dict[str, str], allowed: frozenset[str] = frozenset()) -> list[str]:
    """The names in a job's ``env`` it may not set (sorted)."""
    return sorted(name for name in env if name not in allowed and name not in HARMLESS
                  and (name in FORBIDDEN or name.startswith(FORBIDDEN_PREFIXES)))
