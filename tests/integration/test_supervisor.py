"""The msrun supervisor's guards that need no MindSpore: a busy master port fails fast; how it sees
a rank's process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from mselastic.agent.containment import cgroups, procs
from mselastic.agent.generation import learned, observe
from mselastic.agent.generation.launch import open_own, reachable, spawn_as_worker
from mselastic.agent.generation.preflight import LaunchError, preflight
from mselastic.agent.generation.supervisor import Generation
from mselastic.core.spec import JobSpec
from mselastic.core.states import FailureCause, GenerationState
from tests.builders import local_plan, local_spec
from tests.harness import wait_for


def test_busy_master_port_fails_the_generation_without_starting_msrun(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    with socket.socket() as holder:  # stands for a live scheduler of another job on this port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        plan, spec = local_plan(generation=4, master_port=port), local_spec(tmp)
        open(spec.script, "w").close()
        changes: list[GenerationState] = []

        async def run() -> Generation:
            gen = Generation(plan, spec, "n0", tmp, lambda g, urgent: changes.append(g.state))
            await gen.start()
            await asyncio.wait_for(gen.done.wait(), 5)
            return gen

        gen = asyncio.run(run())
    assert gen.state is GenerationState.FAILED and changes[-1] is GenerationState.FAILED
    assert f"master port {port} is in use" in gen.reason and gen.cause is FailureCause.LAUNCH_NODE
    assert gen.launch.msrun is None  # msrun was never started
    assert gen.report().stopped_at > 0


@pytest.mark.parametrize("what, expected, cause", [
    ("missing script", "script {tmp}/nope.py does not exist", FailureCause.LAUNCH_SPEC),
    ("script is a folder", "script {tmp} is a directory", FailureCause.LAUNCH_SPEC),
    ("uncreatable checkpoint_dir", "checkpoint_dir /proc/nonexistent/ckpt cannot be created: No such file or directory",
     FailureCause.LAUNCH_SPEC),
    ("uncreatable log dir", "log directory /proc/x/logs cannot be created", FailureCause.LAUNCH_NODE),
    ("no msrun", "msrun not found at {tmp}/bin/msrun", FailureCause.LAUNCH_NODE),
])
def test_preflight_names_the_path_and_whose_fault_it_is(tmp_path: os.PathLike[str], what: str, expected: str,
                                                        cause: FailureCause) -> None:
    tmp = str(tmp_path)
    script = os.path.join(tmp, "train.py")
    open(script, "w").close()
    fields = dict(name="j", script=script, checkpoint_dir=os.path.join(tmp, "c"))
    log_dir, msrun = os.path.join(tmp, "logs"), "/bin/true"
    if what == "missing script":
        fields["script"] = os.path.join(tmp, "nope.py")
    elif what == "script is a folder":
        fields["script"] = tmp
    elif what == "uncreatable checkpoint_dir":
        fields["checkpoint_dir"] = "/proc/nonexistent/ckpt"
    elif what == "uncreatable log dir":
        log_dir = "/proc/x/logs"
    else:
        msrun = os.path.join(tmp, "bin", "msrun")
    with pytest.raises(LaunchError) as err:
        preflight(JobSpec(**fields), log_dir, msrun)  # type: ignore[arg-type]
    assert err.value.cause is cause and str(err.value).startswith(expected.format(tmp=tmp)), str(err.value)


def test_root_without_cap_sys_ptrace_still_reads_a_workers_environment() -> None:
    """The unit gives elasticd no CAP_SYS_PTRACE. proc(5) puts /proc/PID/environ behind a
    PTRACE_MODE_READ_FSCREDS check, which a caller whose fsuid/fsgid are the process's own
    passes: ``_environ`` falls back to that when the plain read is refused. Both are run here in
    a root process without CAP_SYS_PTRACE (this machine's kernel lets the plain read through with
    the DAC capabilities the unit keeps; without those it refuses, shown first)."""
    import subprocess
    import sys
    worker = subprocess.Popen(["sleep", "60"], user=65534, group=65534, extra_groups=[],
                              env={"MSELASTIC_RUN_ID": "j.3.abc", "PATH": "/usr/bin:/bin"})
    try:
        bare = ["setpriv", "--bounding-set=-sys_ptrace,-dac_read_search,-dac_override", "--", sys.executable, "-c"]
        plain = (f"import psutil\ntry:\n    psutil.Process({worker.pid}).environ(); print('read')\n"
                 f"except psutil.AccessDenied:\n    print('denied')\n")
        r = subprocess.run([*bare, plain], capture_output=True, text=True, timeout=60)
        assert r.stdout.strip() == "denied", (r.stdout, r.stderr)
        unit = ["setpriv", "--bounding-set=-sys_ptrace", "--", sys.executable, "-c"]
        ours = (f"import psutil\nfrom mselastic.agent.containment.procs import _environ, _environ_as_owner, read_as\n"
                f"read_as(65534)\n"
                f"p = psutil.Process({worker.pid})\n"
                f"print(_environ(p)['MSELASTIC_RUN_ID'], _environ_as_owner(p)['MSELASTIC_RUN_ID'])\n"
                f"status = open('/proc/self/status').read()\n"
                f"print(status.split('Uid:')[1].split()[3], status.split('Gid:')[1].split()[3])\n")
        for how in (unit, bare):  # the fallback alone is enough: without the DAC capabilities too
            r = subprocess.run([*how, ours], capture_output=True, text=True, timeout=60)
            # read, and the fsuid and fsgid are root's again afterwards
            assert r.stdout.split() == ["j.3.abc", "j.3.abc", "0", "0"], (how, r.stdout, r.stderr)
    finally:
        worker.kill()
        worker.wait(timeout=10)


def test_mindspore_heartbeats_every_second_unless_the_job_or_the_admin_says_otherwise(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = str(tmp_path)

    def env(world: int, job_env: dict[str, str]) -> dict[str, str]:
        plan, spec = local_plan(world_size=world), local_spec(tmp, env=job_env)
        return Generation(plan, spec, "n0", tmp, lambda g, urgent: None).launch_env.env()

    fast = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
    assert fast.items() <= env(2, {}).items()
    assert env(2, {"MS_RETRY_INTERVAL_UPPER": "2"})["MS_RETRY_INTERVAL_UPPER"] == "2"  # the job's own
    assert "MS_RETRY_INTERVAL_LOWER" not in env(512, {})  # a large cluster keeps MindSpore's default
    monkeypatch.setenv("MS_RETRY_INTERVAL_LOWER", "3")  # the admin's (MS_* pass from elasticd's environment)
    assert env(2, {})["MS_RETRY_INTERVAL_LOWER"] == "3"


def test_a_rank_seen_through_proc_stat_runs_stops_exits_and_is_not_taken_for_a_reused_pid() -> None:
    """What the supervisor asks of each rank ten times a second, from one read of /proc/<pid>/stat:
    a real process, stopped and continued by real signals, exiting and left unreaped (a zombie, as
    msrun's workers are until msrun reaps them)."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        created = psutil.Process(child.pid).create_time()
        assert procs.alive(child.pid, created) and not procs.stopped(child.pid, created)
        assert not procs.alive(child.pid, created - 5) and not procs.stopped(child.pid, created - 5)  # another process
        os.kill(child.pid, signal.SIGSTOP)
        wait_for("stopped", lambda: procs.stopped(child.pid, created), 5, 0.01)
        assert procs.alive(child.pid, created)
        os.kill(child.pid, signal.SIGCONT)
        wait_for("continued", lambda: not procs.stopped(child.pid, created), 5, 0.01)
        assert procs.exit_status(child.pid, created) is None  # still running
        os.kill(child.pid, signal.SIGKILL)
        wait_for("dead", lambda: not procs.alive(child.pid, created), 5, 0.01)  # a zombie: dead, not gone
        assert procs.exit_status(child.pid, created) == -signal.SIGKILL and not procs.gone(child.pid)
        assert procs.exit_status(child.pid, created + 5) is None
    finally:
        child.kill()
        child.wait()
    assert procs.gone(child.pid) and not procs.alive(child.pid, created)
    assert procs.exit_status(child.pid, created) is None

    code = subprocess.Popen(["sh", "-c", "exit 3"])
    created = psutil.Process(code.pid).create_time()
    try:
        wait_for("exit code 3", lambda: procs.exit_status(code.pid, created) == 3, 5, 0.01)
    finally:
        code.wait()


def test_the_exit_code_of_a_worker_users_rank_is_read_without_cap_sys_ptrace() -> None:
    """The kernel shows a zombie's exit code only to a reader that may ptrace it: elasticd under
    the unit (root without CAP_SYS_PTRACE) read 0 for every rank of the worker user, and reported
    a crashed rank as "exit code 0". A real process of user nobody exits with 3 and is left
    unreaped; a reader with CAP_SYS_PTRACE dropped from its bounding set reads its exit status."""
    nobody = pwd.getpwnam("nobody")
    child = subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                              "sh", "-c", "exit 3"])
    try:
        wait_for("a zombie", lambda: not procs.alive(child.pid, psutil.Process(child.pid).create_time()), 5, 0.01)
        created = psutil.Process(child.pid).create_time()
        code = ("import sys\nfrom mselastic.agent.containment import procs\n"
                f"print(procs.exit_status({child.pid}, {created!r}))\n"
                f"procs.read_as({nobody.pw_uid})\n"
                f"print(procs.exit_status({child.pid}, {created!r}))\n")
        out = subprocess.run(["setpriv", "--bounding-set", "-sys_ptrace", "--", sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["0", "3"], out.stdout  # (the kernel's 0, then the real code)
    finally:
        child.kill()
        child.wait()


def test_a_worker_death_only_msruns_log_tells_is_blamed_on_its_rank(tmp_path: os.PathLike[str]) -> None:
    """msrun exited with code 1 before the agent saw a rank die: its log's line (as msrun 2.10 writes
    it) names the worker's pid and signal, and so the rank: by that pid, or as the only rank whose
    pid was never learned. A pid still running, or a log that names no rank of ours (msrun failed by
    itself), blames none; what the worker user puts at the log's path is not read."""
    tmp = str(tmp_path)
    plan, spec = local_plan(generation=2, workers=(1, 2), node_ids=("n0", "n1")), local_spec(tmp)
    gen = Generation(plan, spec, "n1", tmp, lambda g, urgent: None)
    os.makedirs(gen.log_dir)
    log = os.path.join(gen.log_dir, "msrun.log")
    open(log, "w").close()
    gen.launch.log = open_own(log)  # (as start() opens it for msrun's output)
    gen.launch.msrun = subprocess.Popen(["true"])  # type: ignore[assignment]  # (only its pid is read)
    gen.launch.msrun.wait()
    dead = gen.launch.msrun.pid  # (a worker that exited: reaped, gone)
    line = ("[ERROR] ME(7756:140084068449152,MainProcess):2026-12-02-19:56:22.100.000 "
            "[mindspore/parallel/cluster/process_entity/_api.py:365] Worker process {pid} exit with exception. "
            "Error code: {code}.\n")
    gen.launch.log.write(line.format(pid=dead, code=-9).encode())
    gen.launch.log.flush()
    assert gen.worker_msrun_saw_die() is None  # two ranks whose pids are unknown: which one is not known
    gen.ranks[2].pid = os.getpid()
    assert gen.worker_msrun_saw_die() == (1, dead, "killed by SIGKILL")
    gen.ranks[1].pid = dead
    assert gen.worker_msrun_saw_die() == (1, dead, "killed by SIGKILL") and gen.ranks[1].exit_code == -9
    gen.launch.log.write(line.format(pid=os.getpid(), code=1).encode())  # (a forged line: that pid runs)
    gen.launch.log.flush()
    gen.ranks[1].pid = 0
    assert gen.worker_msrun_saw_die() == (1, dead, "killed by SIGKILL")
    # The path replaced by the worker user (a FIFO would block a read): the file root opened is read.
    os.rename(log, log + ".old")
    os.mkfifo(log)
    assert gen.worker_msrun_saw_die() == (1, dead, "killed by SIGKILL")
    gen.launch.log.close()


def test_the_scheduler_port_counts_as_connected_while_a_peer_holds_a_connection_to_it() -> None:
    """What node 0's agent reads to end a generation before msrun does (the kernel's TCP tables of
    its namespace): a listener alone is not a connection; an accepted one is, until the peer closes
    it (a closed peer's socket lingers in TIME_WAIT or CLOSE_WAIT, which do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert observe.listens(port) and not observe.connected(port)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        try:
            assert observe.connected(port)
            client.close()
            wait_for("the peer's close seen", lambda: not observe.connected(port), 5, 0.01)
        finally:
            client.close()
            accepted.close()


def test_the_other_nodes_wait_for_node_0s_scheduler_until_it_listens_or_they_are_stopped() -> None:
    """What another node's agent waits on before it hands its standbys over: a connection to node 0's
    scheduler port that succeeds, not a socket bound there (its workers would be refused); a stop ends
    the wait; past its limit the wait gives up (the workers are handed over and retry themselves)."""
    async def run() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", 0))
            port = server.getsockname()[1]
            loop = asyncio.get_running_loop()
            loop.call_later(0.4, server.listen)
            t0 = time.monotonic()
            assert await reachable("127.0.0.1", port, 10.0, lambda: False)
            assert time.monotonic() - t0 >= 0.4  # (not before it listened)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bound:  # (bound, never listening)
            bound.bind(("127.0.0.1", 0))
            port = bound.getsockname()[1]
            t0 = time.monotonic()
            assert not await reachable("127.0.0.1", port, 0.5, lambda: False)
            assert 0.5 <= time.monotonic() - t0 < 5.0  # (its limit, give or take one attempt)
            stopped = loop.time() + 0.3
            t0 = time.monotonic()
            assert not await reachable("127.0.0.1", port, 30.0, lambda: loop.time() > stopped)
            assert time.monotonic() - t0 < 5.0  # (the stop, not the 30 s limit)

    asyncio.run(run())


def _pidfds() -> int:
    """How many pidfds this process holds."""
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if _link(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]")


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def test_a_rank_killed_from_outside_is_seen_at_once_not_at_the_watchs_next_look(tmp_path: os.PathLike[str]) -> None:
    """The watch looks at the ranks every ``poll_interval_s``; a rank's exit (its pidfd) wakes it at
    once. With a 60 s interval, a rank SIGKILLed from outside while the watch sleeps is blamed, with
    its signal, within a second; its launch (a stand-in for msrun, the rank's parent) is stopped,
    and the pidfds are closed."""
    tmp = str(tmp_path)
    plan, spec = local_plan(generation=2, workers=1), local_spec(tmp, workers=1)
    held = _pidfds()

    async def run() -> tuple[Generation, float, int]:
        gen = Generation(plan, spec, "n0", tmp, lambda g, urgent: None, poll_interval_s=60.0)
        os.makedirs(gen.log_dir)
        open(os.path.join(gen.log_dir, "msrun.log"), "w").close()  # (as preflight makes it)
        gen.launch.log = open_own(os.path.join(gen.log_dir, "msrun.log"))
        # msrun's stand-in: the rank is its child, which it reaps only when it looks (msrun: once a second).
        launch = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import subprocess, time; p = subprocess.Popen(['sleep', '120']); "
            "print(p.pid, flush=True); time.sleep(120)", stdout=subprocess.PIPE, start_new_session=True)
        try:
            assert launch.stdout is not None
            pid = int(await asyncio.wait_for(launch.stdout.readline(), 30))
            gen.launch.msrun, gen.started_mono = launch, time.monotonic()  # (as start() sets them)
            gen.ranks[0].pid, gen.ranks[0].create_time = pid, psutil.Process(pid).create_time()
            watch = asyncio.create_task(gen.watch())

            async def looked() -> None:  # (its first look opened the rank's pidfd; the next is 60 s away)
                while pid not in gen.exits.fds:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(looked(), 10)
            assert not watch.done() and gen.state is GenerationState.STARTING
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            await asyncio.wait_for(gen.done.wait(), 30)
            await watch
            code = await asyncio.wait_for(launch.wait(), 10)  # stopped by the teardown, not by this test
            return gen, gen.detected_at - killed, code
        finally:
            if launch.returncode is None:
                os.killpg(launch.pid, signal.SIGKILL)  # (its group: the rank too)
                await launch.wait()

    gen, seen_s, launch_code = asyncio.run(run())
    assert gen.state is GenerationState.FAILED and gen.failed_rank == 0 and gen.cause is FailureCause.RANK_EXITED
    assert "exited before finishing" in gen.reason and "SIGKILL" in gen.reason, gen.reason
    assert seen_s < 1.0, seen_s  # (the next look was a minute away)
    assert launch_code != 0
    assert _pidfds() == held  # closed with the generation


@pytest.mark.parametrize("batch", [True, False])
def test_a_jobs_processes_run_under_sched_batch_unless_the_admin_says_otherwise(batch: bool) -> None:
    """What elasticd starts for a job (msrun, a standby's server) runs under SCHED_BATCH, and so do
    the threads and processes it starts in turn; ``batch_scheduling = false`` leaves the default."""
    code = ("import os, subprocess, sys, threading\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0))); t.start(); t.join()\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'],\n"
            "                       capture_output=True, text=True).stdout.strip()\n"
            "print(os.sched_getscheduler(0), seen[0], child)\n")

    async def run() -> str:
        proc = await spawn_as_worker([sys.executable, "-c", code], dict(os.environ), {}, None, os.getcwd(),
                                                batch=batch, stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        return out.decode().strip()

    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # (what the child would inherit without chrt)
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    assert asyncio.run(run()) == f"{policy} {policy} {policy}"


def test_a_generation_that_works_through_its_silence_is_told_from_one_that_does_nothing() -> None:
    """#47: what decides that a single-node job whose ranks are all silent is hung, read from a
    real cgroup (cgroup v2: cpu.stat, cpu.pressure, io.pressure): a process computing (an
    evaluation pass nobody marked), a process forked by it computing while it waits (a data
    loader's worker) and one asleep on a lock (a deadlock), each alone in a group."""
    layout = cgroups.find(f"t-idle-{os.getpid()}")
    if isinstance(layout, str) or not layout.kill_file:
        pytest.skip(f"no cgroup v2 membership here: {layout}")
    scripts = {"computing": "while True: sum(range(10000))",
               "its child computing": "import os, time\nif os.fork() == 0:\n    while True: sum(range(10000))\n"
                                      "time.sleep(3600)",
               "asleep on a lock": "import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()"}
    seen: dict[str, list[bool | None]] = {}
    try:
        for what, script in scripts.items():
            group = cgroups.Group(layout, what.replace(" ", "-")).make()
            p = subprocess.Popen([*cgroups.join_prefix([group]), sys.executable, "-c", script],
                                 start_new_session=True)
            try:
                time.sleep(0.3)
                watch, now = observe.IdleWatch(), time.monotonic()
                seen[what] = []
                for i in range(3):  # (the first look takes a reading; a verdict every BUSY_WINDOW_S after)
                    seen[what].append(watch.look(now + i * learned.BUSY_WINDOW_S, True, group.work))
                    time.sleep(learned.BUSY_WINDOW_S)
                assert watch.look(now + 9, False, group.work) is None  # (a beat: forgotten)
            finally:
                asyncio.run(group.stop())
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    finally:
        for root in layout.roots():
            with contextlib.suppress(OSError):
                os.rmdir(root)
    assert seen == {"computing": [None, False, False], "its child computing": [None, False, False],
                    "asleep on a lock": [None, True, True]}, seen
