"""The generation's shim (mselastic.agent.generation.shim) as elasticd starts it: a real process, a real
deadline file on CLOCK_BOOTTIME, real processes of a "generation" (found by their marker, in their
own session as msrun's workers are) and real signals. The cluster tests show it under a frozen
elasticd (tests/integration/test_split_brain.py)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import psutil

from mselastic.agent.containment import procs as agent_procs
from mselastic.agent.generation import shim
from mselastic.core import fencing
from mselastic.core.contract import ENV_RUN_ID
from tests.harness import TEST_MARK, Processes, holds_for, wait_for

def marker(procs: Processes) -> str:
    """The generation's marker, the test's own (a fence kills every process carrying it: tests
    side by side must not share one)."""
    return f"lenet.1.n0.{procs.mark[:8]}"


def generation(procs: Processes, tmp: str) -> tuple[shim.Paths, psutil.Process]:
    """A rank of a generation (a sleeping process with the generation's marker) and the shim's files."""
    rank = procs.start("rank", [sys.executable, "-c", "import time; time.sleep(600)"], env={ENV_RUN_ID: marker(procs)})
    paths = shim.Paths(os.path.join(tmp, "g000001"))
    record = shim.Record("lenet", 1, "n0", [marker(procs)], ttl_s=3.0)
    shim.write_atomically(paths.record, record.to_json())
    return paths, psutil.Process(rank.pid)


def start_shim(procs: Processes, paths: shim.Paths) -> subprocess.Popen[bytes]:
    return procs.start("shim", [sys.executable, "-m", "mselastic.agent.generation.shim", paths.record])


def test_the_shim_kills_its_generation_once_the_deadline_is_not_moved_on(procs: Processes, tmp_path: str) -> None:
    """A deadline moved on every half second keeps the generation alive; left alone (elasticd
    frozen, gone), the shim writes why and kills it half a round past the deadline, within the
    kill's bound."""
    paths, rank = generation(procs, str(tmp_path))
    shim.write_deadline(paths, fencing.clock() + 1.0)
    sh = start_shim(procs, paths)
    moved_until = time.monotonic() + 3.0
    while time.monotonic() < moved_until:  # elasticd renewing
        shim.write_deadline(paths, fencing.clock() + 1.0)
        assert rank.is_running() and sh.poll() is None
        time.sleep(0.5)
    last = fencing.clock() + 1.0
    shim.write_deadline(paths, last)  # then nothing more
    assert sh.wait(timeout=10) == 0
    gone_at = fencing.clock()
    wait_for("the rank killed", lambda: not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE, 2)
    assert rank.wait(timeout=2) == -signal.SIGKILL
    late = gone_at - last
    assert shim.lag_s(3.0) <= late <= shim.lag_s(3.0) + shim.POLL_S + fencing.KILL_S, late
    with open(paths.fenced) as f:
        fenced = json.load(f)
    assert fenced["version"] == shim.RECORD_VERSION
    assert fenced["reason"].startswith(f"self-fenced: {fencing.Rule.OUTAGE_TOO_LONG.value}")
    assert shim.fence_reason(paths) == fenced["reason"]


def test_the_shim_asked_to_end_leaves_the_generation_alone(procs: Processes, tmp_path: str) -> None:
    """SIGTERM (elasticd: the generation is over) ends the shim and nothing else."""
    paths, rank = generation(procs, str(tmp_path))
    shim.write_deadline(paths, fencing.clock() + 60)
    sh = start_shim(procs, paths)
    time.sleep(0.5)
    sh.send_signal(signal.SIGTERM)
    assert sh.wait(timeout=5) == 0
    holds_for("the rank running", rank.is_running, 1.0)
    assert shim.fence_reason(paths) is None


def test_a_deadline_that_cannot_be_read_never_extends_it(procs: Processes, tmp_path: str) -> None:
    """Garbage in the deadline file (a half-written disk, a stranger's write) is logged and the last
    deadline read stands: the generation is fenced on it."""
    paths, rank = generation(procs, str(tmp_path))
    shim.write_deadline(paths, fencing.clock() + 1.0)
    sh = start_shim(procs, paths)
    time.sleep(0.5)
    with open(paths.deadline, "w") as f:
        f.write('{"version": 1, "until": "forever"}')
    assert sh.wait(timeout=10) == 0
    wait_for("the rank killed", lambda: not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE, 2)
    with open(os.path.join(procs.log_dir, "shim.log")) as f:
        assert "deadline unreadable" in f.read()


def test_a_record_of_another_version_is_refused_in_one_line(procs: Processes, tmp_path: str) -> None:
    paths = shim.Paths(os.path.join(str(tmp_path), "g000001"))
    with open(paths.record, "w") as f:
        f.write(json.dumps({"version": 99, "job": "lenet"}))
    sh = start_shim(procs, paths)
    assert sh.wait(timeout=10) == 2
    with open(os.path.join(procs.log_dir, "shim.log")) as f:
        lines = f.read().splitlines()
    assert len(lines) == 1 and "record version 99, this shim reads version 1" in lines[0], lines


def parent_of(procs: Processes, paths: shim.Paths, tmp: str, script: str) -> tuple[subprocess.Popen[bytes], int, str]:
    """The shim started as elasticd starts it for msrun: ``-- CMD``, the child's output to a log
    descriptor it is handed, its environment (the generation's marker in it) through a pipe, the
    shim's stdout a pipe on which it says the child's pid."""
    log_path = os.path.join(tmp, "msrun.log")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    env_r, env_w = os.pipe()
    try:
        sh = subprocess.Popen([sys.executable, "-I", "-m", "mselastic.agent.generation.shim", paths.record, "--stdout-fd",
                               str(log_fd), "--env-fd", str(env_r), "--cwd", tmp, "--", "sh", "-c", script],
                              pass_fds=(log_fd, env_r), stdout=subprocess.PIPE, start_new_session=True)
    finally:
        os.close(log_fd)
        os.close(env_r)
    with os.fdopen(env_w, "w") as f:
        json.dump(dict(os.environ, **{ENV_RUN_ID: marker(procs), "CHILD_SAYS": "child"}), f)
    procs.started.append(sh)
    assert sh.stdout is not None
    pid = int(sh.stdout.readline())
    return sh, pid, log_path


def test_the_shim_as_msruns_parent_exits_as_msrun_did_and_records_it(procs: Processes, tmp_path: str) -> None:
    """On the cold path the shim is msrun's parent: it says msrun's pid, msrun's output goes to
    its log, msrun runs in the folder it was given, and the shim records msrun's end and exits
    with its code; killed by a signal, the shim is killed by the same one (elasticd's wait on the
    shim is a wait on msrun). A SIGTERM to the shim does not end it before its child."""
    tmp = str(tmp_path)
    paths, _ = generation(procs, tmp)
    shim.write_deadline(paths, fencing.clock() + 60)
    # (The child lives 2 s: long enough to be read from outside on a loaded machine, where 0.5 s was
    # not once; an exited child's environment reads empty.)
    sh, pid, log_path = parent_of(procs, paths, tmp, "pwd; echo $CHILD_SAYS $$; sleep 2; exit 3")
    assert psutil.Process(pid).ppid() == sh.pid
    # (The shim runs as root: the generation's marker is its child's, not its own.)
    assert ENV_RUN_ID not in psutil.Process(sh.pid).environ()
    assert psutil.Process(pid).environ()[ENV_RUN_ID] == marker(procs)
    sh.send_signal(signal.SIGTERM)  # (the generation's process groups get one in a stop with a grace)
    assert sh.wait(timeout=10) == 3
    with open(paths.exit) as f:
        assert json.load(f) == {"version": shim.RECORD_VERSION, "pid": pid, "code": 3}
    with open(log_path) as f:
        assert f.read().split() == [tmp, "child", str(pid)]
    os.unlink(paths.exit)
    sh, pid, _ = parent_of(procs, paths, tmp, "sleep 60")
    os.kill(pid, signal.SIGKILL)
    assert sh.wait(timeout=10) == -signal.SIGKILL


def test_the_shim_as_msruns_parent_fences_it_and_its_children(procs: Processes, tmp_path: str) -> None:
    """Past the deadline the shim kills msrun and everything carrying the generation's markers,
    then exits as msrun did (killed)."""
    tmp = str(tmp_path)
    paths, rank = generation(procs, tmp)
    shim.write_deadline(paths, fencing.clock() + 1.0)
    sh, pid, _ = parent_of(procs, paths, tmp, "sleep 60")
    assert sh.wait(timeout=10) == -signal.SIGKILL
    wait_for("the rank killed", lambda: not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE, 2)
    assert shim.fence_reason(paths) is not None


def test_a_successor_finds_what_it_may_adopt_and_kills_the_rest(procs: Processes, tmp_path: str) -> None:
    """agent.adopt: of the records in its shim folder, a successor elasticd takes only those of its
    own work_dir and node id; of those it may adopt only a generation whose shim and msrun both
    still run (each the process of its start time) and whose deadline has not passed. What it may
    not adopt is killed (the shim by a pinned signal, then by the generation's markers) and its
    files go; another elasticd's record is left alone: one of another namespace, or of a work_dir
    whose lock a live elasticd holds. One of its node and namespace left by an elasticd with
    another work_dir that no longer runs (this one was started with a new work_dir) is killed."""
    from mselastic.agent.generation import adopt
    tmp = str(tmp_path)
    work = os.path.join(tmp, "work")

    def left(name: str, until: float, alive: bool = True, work_dir: str = work, node: str = "n0",
             namespace: str = "/t") -> psutil.Process:
        mark = f"lenet.1.n0.{name}{procs.mark[:8]}"
        rank = procs.start(f"{name}-rank", [sys.executable, "-c", "import time; time.sleep(600)"],
                           env={ENV_RUN_ID: mark})
        sh = procs.start(f"{name}-shim", [sys.executable, "-c", "import time; time.sleep(600)"])
        paths = shim.Paths(os.path.join(tmp, mark))
        shim.write_atomically(paths.record, shim.Record("lenet", 1, node, [mark], 3.0, run_id=mark,
                                                        work_dir=work_dir, namespace=namespace).to_json())
        shim.write_deadline(paths, until)
        pid = rank.pid if alive else 999999
        shim.write_atomically(paths.child, json.dumps({"version": 1, "shim": sh.pid,
                                                       "shim_start": psutil.Process(sh.pid).create_time(),
                                                       "pid": pid, "start": psutil.Process(rank.pid).create_time()}))
        return psutil.Process(rank.pid)

    now = fencing.clock()
    good = left("good", now + 60)
    late = left("late", now - 0.1)  # (its shim is about to fence)
    gone = left("gone", now + 60, alive=False)  # (msrun ended)
    other = left("other", now + 60, work_dir=os.path.join(tmp, "elsewhere"), namespace="/another")
    held_dir = os.path.join(tmp, "held")
    held = left("held", now + 60, work_dir=held_dir)
    orphan = left("orphan", now + 60, work_dir=os.path.join(tmp, "before"))
    os.makedirs(held_dir)
    lock = os.open(os.path.join(held_dir, adopt.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # (a live elasticd with that work_dir)
    try:
        found = {f.record.run_id.rsplit(".", 1)[1].removesuffix(procs.mark[:8]): f
                 for f in adopt.find(tmp, work, "n0", "/t")}
    finally:
        os.close(lock)
    assert set(found) == {"good", "late", "gone", "orphan"}
    assert found["orphan"].child is None and "is gone, and this one runs with work_dir" in found["orphan"].why_not
    assert found["good"].child is not None and found["good"].why_not == ""
    assert found["late"].child is None and "deadline passed" in found["late"].why_not
    assert found["gone"].child is None and found["gone"].why_not == "its shim or msrun is gone"
    for name in ("late", "gone", "orphan"):
        assert adopt.discard(found[name]) == []
        assert not any(os.path.exists(p) for p in found[name].paths.all())
    for p in (late, gone, orphan):
        wait_for("the ranks not adopted killed", lambda: not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, 5)
    assert good.is_running() and other.is_running() and held.is_running()
    assert os.path.exists(found["good"].paths.record)


def test_a_child_disowned_outlives_its_asyncio_transport_and_the_loop(procs: Processes, tmp_path: str) -> None:
    """elasticd leaving a generation to its shim (a restart) closes asyncio's handle on the shim:
    asyncio kills a child it has not seen exit when its transport is closed or collected, so the
    handle is disowned first (agent_procs.disown, which reaches into asyncio's transport: this fails if a
    Python changes it). Without it the child is killed: the test can fail."""
    import asyncio
    import gc

    async def child(disown: bool) -> int:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(600)",
                                                    env=dict(os.environ, **{TEST_MARK: procs.mark}),
                                                    start_new_session=True)
        if disown:
            agent_procs.disown(proc)
        else:
            proc._transport.close()  # type: ignore[attr-defined]  # (as closing it, or collecting it, does)
        return proc.pid

    kept, killed = asyncio.run(child(True)), asyncio.run(child(False))
    gc.collect()
    try:
        holds_for("the disowned child alive", lambda: psutil.Process(kept).status() != psutil.STATUS_ZOMBIE, 0.5)
        wait_for("the other child killed", lambda: not psutil.pid_exists(killed)
                 or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE, 5)
    finally:
        for pid in (kept, killed):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
