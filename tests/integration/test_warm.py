"""Warm relaunches: standby workers with MindSpore imported become the next generation's ranks.

Checked from outside, the way it happens: the kernel's view of a warm rank's environment, a
warm rank against the process msrun starts for the same plan (real msrun, real standbys), and a
rank SIGKILLed under elasticd whose relaunch is handed to the standbys it reported beforehand.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
from typing import Any

import psutil
import pytest

from mselastic.agent.standbys.forkserver import ForkServer, Standby
from mselastic.agent.standbys.pools import StandbyPool
from mselastic.agent.generation.launch import spawn_standby
from mselastic.agent.generation.launch_env import PER_GENERATION_ENV
from mselastic.agent.generation.supervisor import Generation
from mselastic.core import contract
from mselastic.core.model import Plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import GenerationState, JobState
from mselastic.store.embedded import free_port
from mselastic.v1 import elastic_pb2 as pb
from tests.builders import local_plan
from tests.harness import REFUSED, REPO, TEST_MARK, Etcd, agent_status, Processes, check_history, elasticctl, \
    lenet_spec, ms_stamps, standby_processes, start_node, thread_policies, thread_stats, wait_for, \
    generation_processes, holds_for, worker_pids

JOB = "lenet"


def plan(generation: int, port: int, workers: int = 2) -> Plan:
    return local_plan(generation=generation, workers=workers, master_port=port, restart_count=generation - 1)


def test_the_kernels_view_of_a_handed_over_environment_is_the_generations() -> None:
    """/proc/<pid>/environ is the block a process started with; the handover rewrites the marker and
    the slot after it in place, so a warm rank reads there like one msrun started (its marker is the
    generation's, MS_ROLE and RANK_ID are there) and getenv agrees."""
    code = ("import os, sys\n"
            "from mselastic.trainer.standby import _rewrite_environ_block\n"
            "os.environ.pop('MSELASTIC_ENV_SLOT')\n"
            "os.environ.update(MSELASTIC_RUN_ID='lenet.2.n0.ab12', MS_ROLE='MS_WORKER', RANK_ID='1')\n"
            "ok = _rewrite_environ_block(dict(os.environ))\n"
            "import ctypes\n"
            "getenv = ctypes.CDLL(None).getenv\n"
            "getenv.restype = ctypes.c_char_p\n"
            "print(ok, getenv(b'MSELASTIC_RUN_ID').decode(), flush=True)\n"
            "sys.stdin.readline()\n")
    env = {"PATH": "/usr/bin:/bin", "A": "1", contract.ENV_RUN_ID: "standby.lenet.n0.0001",
           contract.ENV_STANDBY_SLOT: "x" * contract.STANDBY_SLOT_BYTES, "Z": "2"}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().split() == ["True", "lenet.2.n0.ab12"]
        seen = psutil.Process(p.pid).environ()
        assert seen[contract.ENV_RUN_ID] == "lenet.2.n0.ab12" and seen["MS_ROLE"] == "MS_WORKER"
        assert seen["RANK_ID"] == "1" and seen["A"] == "1" and seen["Z"] == "2"  # nothing after it lost
    finally:
        p.kill()
        p.wait()
    # Without a slot right after the marker nothing is written.
    code = ("from mselastic.trainer.standby import _rewrite_environ_block\n"
            "print(_rewrite_environ_block({'MSELASTIC_RUN_ID': 'x', 'A': 'b'}))\n")
    env = {"PATH": "/usr/bin:/bin", contract.ENV_RUN_ID: "standby.x", "B": "1", contract.ENV_STANDBY_SLOT: "xx"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout == "False\n"


def test_standby_environment_and_launch_key(tmp_path: os.PathLike[str]) -> None:
    """A standby starts with the job's environment and none of a generation's own values (they come
    with the handover); two generations of one spec share a launch key, another spec does not."""
    tmp = str(tmp_path)
    spec = JobSpec(name="j", script=os.path.join(tmp, "train.py"), checkpoint_dir=os.path.join(tmp, "c"),
                   args=("--lr", "0.1"), workers_per_node=2, env={"GLOG_v": "2"})
    g1, g2 = (Generation(plan(g, 20001 + g), spec, "n0", tmp, lambda g, u: None) for g in (1, 2))
    env = g1.launch_env.standby_env("standby.j.n0.0001")
    assert list(env)[-2:] == [contract.ENV_RUN_ID, contract.ENV_STANDBY_SLOT]
    assert env[contract.ENV_RUN_ID] == "standby.j.n0.0001"
    assert not (PER_GENERATION_ENV - {"HOME"}) & set(env) - {contract.ENV_RUN_ID}
    assert env[contract.ENV_JOB] == "j" and env["GLOG_v"] == "2" and env[contract.ENV_TOTAL_STEPS]
    assert g1.launch_env.launch_key() == g2.launch_env.launch_key()
    other = JobSpec(**{**spec.__dict__, "args": ("--lr", "0.2")})
    g3 = Generation(plan(3, 20004), other, "n0", tmp, lambda g, u: None)
    assert g3.launch_env.launch_key() != g1.launch_env.launch_key()


def test_a_standby_that_cannot_start_leaves_relaunches_cold() -> None:
    """A standby that exits before it is ready (the worker user cannot import MindSpore, ...) is not
    started again and again: the pool says why and hands out nothing."""
    async def run() -> StandbyPool:
        async def spawn(marker: str, fd: int) -> asyncio.subprocess.Process:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-c", "import sys; print('boom'); sys.exit(3)", stdin=fd, stdout=fd, stderr=fd,
                start_new_session=True)

        pool = StandbyPool("j", "n0", "key", spawn)
        pool.fill(3)
        assert pool._filling is not None
        await asyncio.wait_for(pool._filling, 30)
        pool.fill(3)  # not again
        assert pool._filling.done() and not pool.standbys
        assert pool.take(1) == []
        await pool.close()
        return pool

    pool = asyncio.run(run())
    assert re.fullmatch(r"standby pid \d+ exited with code 3 before it was ready", pool.broken), pool.broken


DUMP = """
import json, os, socket, sys, time
role = os.environ.get("MS_ROLE", "?")
name = "scheduler" if role == "MS_SCHED" else "worker-" + os.environ.get("RANK_ID", "?")
if role == "MS_SCHED":  # a scheduler listens on its port (the warm path waits for that before the workers)
    server = socket.socket()
    server.bind((os.environ["MS_SCHED_HOST"], int(os.environ["MS_SCHED_PORT"])))
    server.listen()
with open("/proc/self/environ", "rb") as f:
    kernel = dict(e.decode().split("=", 1) for e in f.read().split(b"\\0") if b"=" in e)
out = dict(env=dict(os.environ), kernel=kernel, argv=sys.argv, cwd=os.getcwd(), path0=sys.path[0],
           session_leader=os.getsid(0) == os.getpid(), main=__name__,
           stdout=os.readlink("/proc/self/fd/1"), stderr=os.readlink("/proc/self/fd/2"),
           stdin=os.readlink("/proc/self/fd/0"))
with open(os.path.join(sys.argv[1], name + ".tmp"), "w") as f:
    json.dump(out, f)
os.rename(os.path.join(sys.argv[1], name + ".tmp"), os.path.join(sys.argv[1], name + ".json"))
# A rank's exit ends the generation at once (elasticd tears the others down): leave once all wrote.
names = ("scheduler.json", "worker-0.json", "worker-1.json")
deadline = time.monotonic() + 30
while role != "MS_SCHED" and time.monotonic() < deadline and \
        not all(os.path.exists(os.path.join(sys.argv[1], n)) for n in names):
    time.sleep(0.01)
if role == "MS_SCHED":
    while True:  # until the generation is torn down (msrun's scheduler outlives its workers too)
        time.sleep(0.1)
# Seen alive by the agent first: a rank that exits 0 before the agent's first look at msrun's children
# (its scheduler alive, msrun waits) is found by the start-up timeout only (30 s: half the runs).
time.sleep(1.0)
"""


@pytest.mark.slow
def test_a_warm_rank_starts_as_msrun_would_have_started_it(tmp_path: os.PathLike[str]) -> None:
    """The same plan twice on one node: msrun starting the scheduler and two ranks (cold), then
    standbys handed it (warm), forked by the pool's fork server. Each process records what it was
    started with; the warm ones must match msrun's: every variable (the generation's own values
    aside), argv, working directory, sys.path[0], __main__, a worker's session of its own, output
    into msrun's log file names, and the kernel's view of the environment carrying the generation's
    marker and msrun's variables."""
    tmp = str(tmp_path)
    port = free_port()
    outs = {kind: os.path.join(tmp, kind) for kind in ("cold", "warm")}
    script = dump_spec(tmp, "").script

    async def run(generation: int, out: str, warm: bool) -> Generation:
        gen = Generation(plan(generation, port), dump_spec(tmp, out), "n0", tmp, lambda g, u: None)
        pool = None
        if warm:
            pool = StandbyPool("j", "n0", gen.launch_env.launch_key(), functools.partial(spawn_standby, gen.launch_env))
            pool.fill(3)
            await wait_async(lambda: len(pool.ready()) == 3, 120)
            gen.take_standbys(pool.take(3))
            assert pool.server is not None and len(gen.launch.standbys) == 3
            assert all(psutil.Process(sb.pid).ppid() == pool.server.pid for sb in gen.launch.standbys)
        await gen.start()
        await asyncio.wait_for(gen.done.wait(), 60)
        if pool is not None:
            await pool.close()
        return gen

    asyncio.run(run(1, outs["cold"], warm=False))
    gen = asyncio.run(run(2, outs["warm"], warm=True))
    # (The dump script's ranks exit without a "finished" heartbeat: the generation ends as failed,
    # blamed on a rank, not on the handover.)
    assert gen.report().warm and gen.state is GenerationState.FAILED and gen.failed_rank in (0, 1), gen.reason
    per_generation = {contract.ENV_GENERATION, contract.ENV_RESTART_COUNT, contract.ENV_HEARTBEAT,
                      contract.ENV_RUN_ID, contract.ENV_STOP_FILE}
    for name in ("scheduler", "worker-0", "worker-1"):
        cold, warm = (json.load(open(os.path.join(outs[k], name + ".json"))) for k in ("cold", "warm"))
        assert warm["argv"][1:] == [outs["warm"]] and cold["argv"][1:] == [outs["cold"]]
        assert warm["argv"][0] == cold["argv"][0] == script
        assert warm["cwd"] == cold["cwd"] and warm["path0"] == cold["path0"] == os.path.dirname(script)
        assert warm["main"] == cold["main"] == "__main__"
        # Workers: a session of their own (msrun's setsid). The scheduler shares msrun's cold; warm
        # it has its own (there is no msrun): what tears a generation down finds it either way.
        assert warm["session_leader"] and cold["session_leader"] is (name != "scheduler")
        for fd in ("stdout", "stderr"):
            assert os.path.basename(warm[fd]) == os.path.basename(cold[fd]) == \
                ("scheduler.log" if name == "scheduler" else f"worker_{name[-1]}.log")
            assert "g000002" in warm[fd] and "g000001" in cold[fd]
        assert warm["stdin"] == "/dev/null"
        env_cold, env_warm = cold["env"], warm["env"]
        assert set(env_warm) == set(env_cold), (set(env_warm) ^ set(env_cold))
        differing = {k for k in env_cold if env_cold[k] != env_warm[k]}
        assert differing <= per_generation, differing
        assert env_warm[contract.ENV_GENERATION] == "2" and env_warm[contract.ENV_RUN_ID] == gen.run_id
        # The kernel's view: the generation's marker and msrun's own variables, as for a cold process.
        msrun_vars = {k for k in env_cold if k.startswith(("MS_", "RANK_", "DEVICE_ID"))} - {"MS_RETRY_INTERVAL_LOWER",
                                                                                          "MS_RETRY_INTERVAL_UPPER"}
        assert {k: warm["kernel"].get(k) for k in msrun_vars} == {k: env_warm[k] for k in msrun_vars}
        assert warm["kernel"][contract.ENV_RUN_ID] == gen.run_id
        assert contract.ENV_STANDBY_SLOT not in env_warm


@pytest.mark.slow
def test_a_standby_killed_before_its_handover_sends_the_generation_cold(tmp_path: os.PathLike[str]) -> None:
    """Standbys taken for a generation, one SIGKILLed before the handover (as the OOM killer would):
    the generation starts cold under msrun instead of failing its launch (nothing blamed on the
    node), every process of it starts, and the job's pool is not taken for broken. Then the fork
    server itself is SIGKILLed: the standbys it forked die with it (none is left to join a later
    generation), and the next fill starts another server and forks from it."""
    tmp = str(tmp_path)
    out = os.path.join(tmp, "out")
    spec = dump_spec(tmp, out)

    async def run() -> tuple[Generation, int, list[int]]:
        gen = Generation(plan(1, free_port()), spec, "n0", tmp, lambda g, u: None)
        pool = StandbyPool("j", "n0", gen.launch_env.launch_key(), functools.partial(spawn_standby, gen.launch_env))
        pool.fill(3)
        await wait_async(lambda: len(pool.ready()) == 3, 120)
        gen.take_standbys(pool.take(3))
        victim = gen.launch.standbys[1].pid
        os.kill(victim, signal.SIGKILL)
        await wait_async(lambda: not gen.launch.standbys[1].alive, 10)  # (its fork server reaped it and said so)
        await gen.start()
        await asyncio.wait_for(gen.done.wait(), 60)
        broken = pool.broken
        assert broken == "", broken
        # The fork server killed: its standbys go with it; a fill starts another.
        pool.fill(3)
        await wait_async(lambda: len(pool.ready()) == 3, 30)
        first, orphans = pool.server, [sb.pid for sb in pool.standbys]
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        # Gone by their death signal, while elasticd still holds their sockets open (the next fill
        # would close them).
        await wait_async(lambda: all(gone(pid) for pid in orphans), 10)
        # The agent sees them ended (the kernel's word; their code would be the dead server's).
        await wait_async(lambda: not any(sb.alive for sb in pool.standbys), 10)
        pool.fill(3)
        await wait_async(lambda: len(pool.ready()) == 3, 120)
        assert pool.server is not None and pool.server.pid != first.pid and not pool.broken
        assert all(psutil.Process(sb.pid).ppid() == pool.server.pid for sb in pool.standbys)
        await pool.close()
        return gen, victim, orphans

    gen, victim, orphans = asyncio.run(run())
    assert not gen.report().warm and gen.launch.msrun is not None
    # (The dump script's ranks exit without a "finished" heartbeat: blamed on a rank, not the launch.)
    assert gen.state is GenerationState.FAILED and gen.failed_rank in (0, 1), gen.reason
    for name in ("scheduler", "worker-0", "worker-1"):
        with open(os.path.join(out, name + ".json")) as f:
            started = json.load(f)
        # msrun's: its scheduler shares msrun's session (a warm one leads its own), in msrun's log files.
        assert started["session_leader"] is (name != "scheduler") and "g000001" in started["stdout"], started
    for pid in [victim, *orphans]:
        assert gone(pid), pid


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_a_standby_taken_before_it_was_ready_that_dies_sends_the_generation_cold(tmp_path: os.PathLike[str]) -> None:
    """Standbys taken before they said they are ready (a few milliseconds after a fork; they never
    do here: each is a process that only sleeps), one SIGKILLed while the generation waits for
    them: the generation starts cold under msrun, every process of it starts, nothing is blamed on
    the node."""
    tmp = str(tmp_path)
    out = os.path.join(tmp, "out")
    spec = dump_spec(tmp, out)

    async def sleeper(marker: str, fd: int) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(120)", stdin=fd,
                                                    stdout=fd, stderr=fd, start_new_session=True)

    async def run() -> tuple[Generation, int]:
        gen = Generation(plan(1, free_port()), spec, "n0", tmp, lambda g, u: None)
        gen.take_standbys([await Standby.start(sleeper, f"standby.j.n0.{i}") for i in range(3)])
        victim = gen.launch.standbys[1].pid
        await gen.start()  # (all alive when taken: it waits for them to be ready, warm)
        assert gen.launch.msrun is None
        os.kill(victim, signal.SIGKILL)
        await asyncio.wait_for(gen.done.wait(), 60)
        return gen, victim

    gen, victim = asyncio.run(run())
    assert not gen.report().warm and gen.launch.msrun is not None
    assert gen.state is GenerationState.FAILED and gen.failed_rank in (0, 1), gen.reason
    for name in ("scheduler", "worker-0", "worker-1"):
        with open(os.path.join(out, name + ".json")) as f:
            assert "g000001" in json.load(f)["stdout"]
    assert gone(victim)


FORGER = """
import json, os, socket, sys, time
ctl = socket.socket(fileno=0)
print("mselastic-standby-ready", os.getpid(), flush=True)
def say(what):
    ctl.sendall(("mselastic-standby-forks " + what + "\\n").encode())
def asked():
    msg, fds, _, _ = socket.recv_fds(ctl, 4096, 1)
    return json.loads(msg)["fork"]
def child(uid):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if uid is not None:
                os.setuid(uid)
            os.write(w, b"x")
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(w)
    os.read(r, 1)  # (named once it runs as that user: the check is not raced)
    os.close(r)
    return pid
say(json.dumps({"forked": int(sys.argv[1]), "marker": asked()}))  # another process, not its child
say(json.dumps({"forked": child(65534), "marker": asked()}))  # its child, but another user's
marker = asked()
say(json.dumps({"forked": os.getpid(), "marker": "standby.j.n0.0"}))  # an answer to no request
pid = child(None)
say(json.dumps({"forked": pid, "marker": marker}))
say(json.dumps({"exit": pid, "code": 0}))  # while it runs
for garbage in ("{not json", "[1]", '{"forked": 1e999, "marker": "x"}', '{"exit": "x"}'):
    say(garbage)
say(json.dumps({"error": "all said", "marker": asked()}))  # (read after all the above)
time.sleep(120)
"""


def test_a_fork_server_is_not_believed_without_the_kernels_word() -> None:
    """A fork server runs as the worker user, and a job's code may run in it. One that names a
    process that is not its own child (here another user's), or a child of its that runs as another
    user, is refused (elasticd, root, would signal it); an answer to no request is dropped; one that
    says a running standby exited is not believed, and that standby still counts as running (its
    server is not stopped under it); lines that do not parse cost it nothing."""
    victim = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "120"])

    async def run() -> None:
        async def spawn(marker: str, fd: int) -> asyncio.subprocess.Process:
            return await asyncio.create_subprocess_exec(sys.executable, "-c", FORGER, str(victim.pid), stdin=fd,
                                                        stdout=fd, stderr=fd, start_new_session=True)

        server = await ForkServer.start(spawn, "standby.j.n0.forger")
        ours, theirs = socket.socketpair()
        try:
            assert await server.await_ready(30)
            for i in (1, 2):
                with pytest.raises(RuntimeError, match="not a child of its own, of its own user"):
                    await server.fork(f"standby.j.n0.{i}", theirs.fileno())
            child = await server.fork("standby.j.n0.3", theirs.fileno())
            assert child.pid != server.pid
            with pytest.raises(RuntimeError, match="all said"):  # (so the false exit and the garbage were read)
                await server.fork("standby.j.n0.4", theirs.fileno())
            assert child.returncode is None and not gone(child.pid) and server.alive
            assert server.running() == [child]
            child.kill()
            await asyncio.wait_for(child.wait(), 10)  # (ended: the kernel's word; the forger never reaps it)
            assert server.running() == []
        finally:
            ours.close()
            theirs.close()
            await server.close()

    try:
        asyncio.run(run())
        assert victim.poll() is None  # never signalled
        # Nothing the forger started is left (its children have no death signal: its process group,
        # SIGKILLed at the close; their end, the kernel's, may come a moment later on a busy machine).
        wait_for("the forger's children gone", lambda: not [
            p for p in psutil.process_iter(["cmdline", "status"]) if p.info["cmdline"] and FORGER in p.info["cmdline"]
            and p.info["status"] != psutil.STATUS_ZOMBIE], 10, 0.1)
    finally:
        victim.kill()
        victim.wait()


def dump_spec(tmp: str, out: str) -> JobSpec:
    """The job of ``DUMP`` (written under ``tmp`` once), recording what its processes were started
    with in ``out`` (made here)."""
    script = os.path.join(tmp, "job", "dump.py")
    if not os.path.exists(script):
        os.makedirs(os.path.dirname(script))
        with open(script, "w") as f:
            f.write(DUMP)
    if out:
        os.makedirs(out, exist_ok=True)
    return JobSpec(name="j", script=script, args=(out,), checkpoint_dir=os.path.join(tmp, "c"), workers_per_node=2,
                   startup_timeout_s=30)


async def wait_async(cond: Any, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.1)


def standbys(endpoint: str) -> list[pb.StandbyStatus]:
    return list(agent_status(endpoint).standbys)


def sync_waits(log: str) -> list[float]:
    """Seconds each MindSpore CPU collective address exchange took in a worker log ("start sync" to
    "already been initialized"): 3.0 s or more for a rank that slept MindSpore's full poll."""
    stamps = sorted(ms_stamps(log, "start sync start") + ms_stamps(log, "has already been initialized"))
    return [b - a for a, b in zip(stamps[::2], stamps[1::2])]


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The cores each thread of a process may run on."""
    cores = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores.add(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            pass
    return cores


def thread_nices(pid: int) -> set[int]:
    """The nice values of a process's threads (field 19 of their stat)."""
    return thread_stats(pid, 19)


def standbys_may_renice() -> bool:
    """This test run may lower a standby to nice 19 and bring it back: it runs at nice 0 with
    CAP_SYS_NICE (bit 23 of the effective set), as root does here (workers run as root on this
    machine). Elsewhere the nice assertions are skipped, not failed."""
    with open("/proc/self/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return os.getpriority(os.PRIO_PROCESS, 0) == 0 and bool(eff & (1 << 23))


@pytest.mark.slow
def test_a_killed_rank_is_replaced_by_standbys_and_the_job_finishes(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    """elasticd keeps three standbys for the 2-rank job once it trains (two ranks and a scheduler);
    a rank SIGKILLed from outside is relaunched warm: generation 2's ranks are exactly those standby
    processes (seen in /proc as generation 2's, like msrun's), it resumes from the checkpoint; new
    standbys replace the used ones; standbys wait at nice 19, ranks train at 0; with snapshots on
    (the default) it loses at most a step. A warm rank that raises is a failed rank like any other
    (generation 3, warm again), and the job finishes; no standby is left once it succeeded. No rank
    of any generation sleeps out MindSpore's 3 s address poll: a local peer's return from init()
    gets it nudged. The standbys, their server and msrun's scheduler run under SCHED_BATCH, the
    ranks, cold and warm, are back under the default policy and on every core once they joined,
    and the warm ranks' registrations with their (listening) scheduler fail at most once: under
    the default policy MindSpore's TCP client loses a race with its own event loop."""
    total = 50
    tmp = str(tmp_path)
    work = os.path.join(tmp, "work")
    endpoint = start_node(procs, etcd, namespace, work, "--warm-standbys", "true")
    spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                      total_steps=total, args=["--data", digits, "--out", os.path.join(tmp, "out"), "--lr", "0.05",
                                               "--step-sleep-s", "0.1"],
                      env={"MSELASTIC_FAULT": "exception:rank=0:generation=2:step=45"},
                      snapshot_interval_steps=1)  # (the default: warm relaunches and snapshots together)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    ready = wait_for("three standbys ready", lambda: len(s := [x for x in standbys(endpoint) if x.ready]) == 3 and s,
                     180, 0.2)
    pids = {s.pid for s in ready}
    for p in standby_processes(procs):  # not part of generation 1: no cluster variables, a marker of their own
        env = p.environ()
        assert "MS_ROLE" not in env and "RANK_ID" not in env and not env[contract.ENV_RUN_ID].startswith("lenet.1.")
    # The three, and the fork server they were forked from (a standby that never takes a generation).
    servers = {psutil.Process(pid).ppid() for pid in pids}
    assert len(servers) == 1 and {p.pid for p in standby_processes(procs)} == pids | servers
    markers = {p.environ()[contract.ENV_RUN_ID] for p in standby_processes(procs)}
    assert len(markers) == 4, markers  # each its own, in the kernel's view too
    if standbys_may_renice():  # they wait nicely
        assert all(thread_nices(pid) == {19} for pid in pids), {pid: thread_nices(pid) for pid in pids}
    wait_for("a checkpoint", lambda: (r := etcd.report(JOB, 1, "n0")) and r.step >= 12, 120, 0.1)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # (what elasticd's children inherit without chrt)
    cold = worker_pids(procs, 1)
    scheduler = [p.pid for p in generation_processes(procs, 1) if p.environ().get("MS_ROLE") == "MS_SCHED"]
    batch = {pid: thread_policies(pid) for pid in [*scheduler, *pids, *servers]}
    assert len(scheduler) == 1 and all(p == {os.SCHED_BATCH} for p in batch.values()), batch
    assert all(thread_policies(pid) == {os.SCHED_OTHER} for pid in cold.values()), \
        {pid: thread_policies(pid) for pid in cold.values()}
    os.kill(cold[1], signal.SIGKILL)
    second = wait_for("generation 2 training", lambda: (r := etcd.report(JOB, 2, "n0")) and r.first_step_at and r,
                      60, 0.1)
    reached = etcd.report(JOB, 1, "n0").step  # type: ignore[union-attr]
    assert second.warm and reached - 1 <= second.resumed_step <= reached, (reached, second.resumed_step)
    ranks = worker_pids(procs, 2)  # from /proc/<pid>/environ, as for msrun's workers
    assert len(ranks) == 2 and set(ranks.values()) < pids, (ranks, pids)
    if standbys_may_renice():
        assert all(thread_nices(pid) == {0} for pid in ranks.values()), {p: thread_nices(p) for p in ranks.values()}
    assert all(thread_policies(pid) == {os.SCHED_OTHER} for pid in ranks.values()), \
        {pid: thread_policies(pid) for pid in ranks.values()}
    cores = frozenset(os.sched_getaffinity(0))  # (init() ran on one core; every thread is back on all)
    assert all(thread_cores(pid) == {cores} for pid in ranks.values()), {p: thread_cores(p) for p in ranks.values()}
    fresh = wait_for("three new standbys",
                     lambda: len(s := [x.pid for x in standbys(endpoint) if x.ready and x.pid not in pids]) == 3 and s,
                     120, 0.2)
    failed = wait_for("generation 2 to fail", lambda: (r := etcd.report(JOB, 2, "n0")) and r.state.terminal and r,
                      120, 0.1)
    assert failed.state is GenerationState.FAILED and failed.failed_rank == 0 and "exit code 1" in failed.reason, failed
    third = wait_for("generation 3 training", lambda: (r := etcd.report(JOB, 3, "n0")) and r.first_step_at and r,
                     60, 0.1)
    assert third.warm and set(worker_pids(procs, 3).values()) < set(fresh)
    assert {psutil.Process(pid).ppid() for pid in fresh} == servers  # forked by the same server
    status = wait_for("job to finish", lambda: (s := etcd.status(JOB)) and s.state.terminal and s, 240, 0.5)
    assert status.state is JobState.SUCCEEDED, status.message
    assert status.generation == 3 and etcd.report(JOB, 3, "n0").state is GenerationState.SUCCEEDED  # type: ignore
    check_history(etcd, JOB, total, snapshots=True)
    assert not etcd.report(JOB, 1, "n0").warm  # type: ignore[union-attr]
    wait_for("standbys stopped after the job succeeded", lambda: not standby_processes(procs), 30)
    logs = os.path.join(work, "logs", JOB)
    with open(os.path.join(logs, "g000002", "msrun.log")) as f:
        assert f.read().count("(warm: standby pid") == 3
    for g in ("g000001", "g000002", "g000003"):
        waits = [w for r in (0, 1) for w in sync_waits(os.path.join(logs, g, f"worker_{r}.log"))]
        assert len(waits) == 2 and max(waits) < 2.9, (g, waits)
    refused = []  # (the cold generation's workers may start before their scheduler listens)
    for g in ("g000002", "g000003"):
        for r in (0, 1):
            with open(os.path.join(logs, g, f"worker_{r}.log"), errors="replace") as f:
                refused += [line for line in f if REFUSED in line]
    # Rare, not impossible (docs/journal/2026-12.md, "... SCHED_BATCH"): at most one in these eight connections
    # (two warm generations, two ranks, two connections each; 4-5 under the default policy).
    assert len(refused) <= 1, refused


@pytest.mark.skipif(not standbys_may_renice(), reason="needs nice 0 and CAP_SYS_NICE (root)")
@pytest.mark.parametrize("sys_nice,expected", [(False, "None 0"), (True, "0 19")])
def test_a_standby_lowers_its_priority_only_when_it_can_raise_it_back(sys_nice: bool, expected: str) -> None:
    """Without CAP_SYS_NICE (dropped from the bounding set, as the unit does) and with RLIMIT_NICE 0
    (the default), a standby could not go back from nice 19 to 0: it stays at 0 rather than lower
    itself for good. With it, it waits at 19, and every thread goes back to 0. (The unit's
    ``LimitNICE=+0``, RLIMIT_NICE 20, allows the way back without the capability; raising that limit
    takes CAP_SYS_RESOURCE, which this machine's root lacks: not tested here.)"""
    code = ("import os, threading\n"
            "from mselastic.trainer.standby import _wait_nicely, _renice\n"
            "was = _wait_nicely()\n"
            "print(was, os.getpriority(os.PRIO_PROCESS, 0))\n"
            "if was is not None:\n"
            "    t = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True); t.start()\n"
            "    _renice(was)\n"
            "    print(sorted({os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir('/proc/self/task')}))\n")
    drop = [] if sys_nice else ["setpriv", "--bounding-set", "-sys_nice", "--"]
    out = subprocess.run(["prlimit", "--nice=0", *drop, sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == expected, out.stdout
    if sys_nice:
        assert lines[1] == "[0]", out.stdout  # the thread started at 19 is back at 0 too


LEFT_AGENT = """
import asyncio, functools, json, os, sys, time
from mselastic.agent.generation.launch import spawn_standby
from mselastic.agent.generation.supervisor import Generation
from mselastic.agent.standbys.pools import StandbyPool
from tests.integration.test_warm import dump_spec, plan

tmp, script = sys.argv[1], sys.argv[2]

async def main():
    gen = Generation(plan(1, 1), dump_spec(tmp, ""), "n0", tmp, lambda g, u: None)
    os.makedirs(gen.log_dir, exist_ok=True)
    pool = StandbyPool("j", "n0", "k", functools.partial(spawn_standby, gen.launch_env))
    pool.fill(4)
    while len(pool.ready()) < 4:
        await asyncio.sleep(0.05)
    ranks = dict(zip("abc", pool.take(3)))
    for name, (rank, code) in zip("abc", [(r, c) for r, c in zip(ranks.values(), (3, 5, 4))]):
        await rank.hand_over({}, [script, os.path.join(tmp, "go-" + name), str(code)], tmp,
                             os.path.join(tmp, f"rank-{name}.log"))
    while not all(os.path.exists(os.path.join(tmp, "started-" + name)) for name in "abc"):
        await asyncio.sleep(0.05)
    await pool.server.keep([ranks["a"].pid, ranks["c"].pid])  # (b: a generation never recorded)
    print(json.dumps(dict(server=pool.server.pid, idle=pool.ready()[0].pid, exits=gen.launch_env.standby_exits(
        pool.server.marker), **{name: r.pid for name, r in ranks.items()})), flush=True)
    await asyncio.sleep(600)  # (SIGKILLed: elasticd crashing)

asyncio.run(main())
"""

RANK = """
import os, sys, time
go, code = sys.argv[1], int(sys.argv[2])
open(go.replace("go-", "started-"), "w").close()
while not os.path.exists(go):
    time.sleep(0.05)
sys.exit(code)
"""


@pytest.mark.slow
def test_a_fork_server_outlives_a_crashed_elasticd_while_a_rank_it_kept_runs(
        procs: Processes, tmp_path: os.PathLike[str]) -> None:
    """#45, warm generations outliving elasticd: an elasticd's side of a real fork server (its pool,
    four standbys forked, three handed a script as a warm launch does, two of them named to keep:
    their generation's record written) SIGKILLed. The rank not kept is killed at once (a generation
    whose record was never written has no guard: it must not train on), the idle standby exits,
    the server stays, the kept ranks train on. One ends (code 3) before the next elasticd adopts
    it: adopted as ended, its code read from the server's record. The other is adopted alive (an
    Orphan: its end by pidfd) and ends with code 4, which the adopter reads; the server, its last
    kept child gone, exits by itself. Before the change the ranks died with the server, and the
    server with elasticd: the test fails."""
    from mselastic.agent.standbys.forkserver import Orphan

    tmp = str(tmp_path)
    script = os.path.join(tmp, "rank.py")
    with open(script, "w") as f:
        f.write(RANK)
    daemon = procs.start("agent-side", [sys.executable, "-c", LEFT_AGENT, tmp, script])
    said = wait_for("the ranks handed over and kept", lambda: _last_json(procs, "agent-side"), 180, 0.2)
    server, idle, a, b, c = (psutil.Process(said[k]) for k in ("server", "idle", "a", "b", "c"))
    assert all(p.ppid() == server.pid for p in (idle, a, b, c))
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.wait(10)
    wait_for("the idle standby and the rank not kept gone", lambda: not _running(idle) and not _running(b), 10)
    holds_for("the server and the kept ranks running without elasticd",
              lambda: _running(server) and _running(a) and _running(c), 1.0)
    open(os.path.join(tmp, "go-a"), "w").close()
    wait_for("rank a ended and reaped by its server", lambda: not psutil.pid_exists(a.pid), 10)

    async def adopt() -> tuple[int, int]:
        ended = Orphan(a.pid, a.create_time(), said["exits"], (server.pid, server.create_time()))
        alive = Orphan(c.pid, c.create_time(), said["exits"], (server.pid, server.create_time()))
        assert alive.returncode is None
        open(os.path.join(tmp, "go-c"), "w").close()
        return await asyncio.wait_for(ended.wait(), 20), await asyncio.wait_for(alive.wait(), 20)

    assert asyncio.run(adopt()) == (3, 4)
    wait_for("the server gone, its last kept child ended", lambda: not _running(server), 10)
    with open(said["exits"]) as f:
        ends = [json.loads(line) for line in f]
    assert {"exit": a.pid, "code": 3} in ends and {"exit": c.pid, "code": 4} in ends, ends
    assert {"exit": b.pid, "code": -signal.SIGKILL} in ends, ends


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _last_json(procs: Processes, name: str) -> dict[str, Any] | None:
    with open(os.path.join(procs.log_dir, name + ".log")) as f:
        for line in reversed(f.read().splitlines()):
            if line.startswith("{"):
                return json.loads(line)
    return None
