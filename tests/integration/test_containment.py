"""A job can harm neither elasticd nor another job (issue #31): what a job puts in the folders it
controls never holds elasticd, whose reads of them are bounded, nor keeps it from stopping."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import time

import psutil
import pytest

from tests.harness import Etcd, Processes, elasticctl, lenet_spec, start_node, wait_for

pytestmark = pytest.mark.slow

#: The job's script: it makes its checkpoint_dir's latest.json a FIFO nobody writes, then never
#: reaches a step (elasticd, looking for the step it resumes from, reads that file).
PLANT = """import os, sys, time
path = os.path.join(sys.argv[1], "latest.json")
if os.environ.get("MS_ROLE") == "MS_WORKER" and not os.path.lexists(path):  # (msrun runs it as the scheduler too)
    os.mkfifo(path)
time.sleep(3600)
"""


def test_a_fifo_a_device_link_or_a_huge_file_in_a_jobs_folder_never_holds_elasticd(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str], digits: str) -> None:
    """Job a's own script plants a FIFO where elasticd reads a job's progress (then the test swaps
    in a link to /dev/zero and a 10 GiB sparse file): every `elasticctl jobs` still answers at
    once (before: 12 of 12 hung past 5 s, six threads stuck in open()), an honest job b submitted
    meanwhile trains, and a SIGTERM stops elasticd within its grace (before: alive five minutes
    later)."""
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"))
    ckpt = os.path.join(tmp, "a-ckpt")
    script = os.path.join(tmp, "plant.py")
    with open(script, "w") as f:
        f.write(PLANT)
    spec = lenet_spec(os.path.join(tmp, "a.toml"), "a", tmp, ckpt, 10, workers=1, script=script, args=[ckpt],
                      startup_timeout_s=600)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    latest = os.path.join(ckpt, "latest.json")
    wait_for("the job's FIFO", lambda: os.path.exists(latest) and stat.S_ISFIFO(os.lstat(latest).st_mode), 60, 0.1)

    def link() -> None:
        os.remove(latest)
        os.symlink("/dev/zero", latest)

    def huge() -> None:
        os.remove(latest)
        with open(latest, "wb") as f:
            f.truncate(10 << 30)

    took = []
    for plant in (None, link, huge):
        if plant is not None:
            plant()
        for _ in range(4):
            t0 = time.monotonic()
            r = elasticctl("jobs", endpoint=endpoint)
            took.append(time.monotonic() - t0)
            assert r.returncode == 0 and "RUNNING" in r.stdout, r.stdout + r.stderr
    assert max(took) < 1.5, [round(t, 2) for t in took]  # (a read given up on takes READ_S, 2 s)
    status = etcd.status("a")
    assert status is not None and status.generation == 1, status  # (the same generation all along)
    # Another job still starts and trains beside it.
    b = lenet_spec(os.path.join(tmp, "b.toml"), "b", os.path.join(tmp, "b-out"), os.path.join(tmp, "b-ckpt"), 5,
                   workers=1)
    assert elasticctl("submit", b, endpoint=endpoint).returncode == 0
    wait_for("job b's first step", lambda: (r := etcd.report("b", 1, "n0")) and r.step >= 1, 120, 0.2)
    elasticd = procs.started[0]
    t0 = time.monotonic()
    elasticd.send_signal(signal.SIGTERM)
    assert elasticd.wait(30) == 0
    print(f"elasticctl jobs took at most {max(took):.2f}s; elasticd stopped {time.monotonic() - t0:.1f}s after SIGTERM")


def _cgroup_of(pid: int) -> str:
    """The v2 cgroup of ``pid`` (its ``0::`` line), "" when it is gone."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), "")
    except OSError:
        return ""


#: A rank that starts a process out of every reach but a cgroup's: double-forked (its parent init),
#: in a session and process group of its own, its environment emptied (no marker), then never
#: reaches a step. Its pid goes to argv[1].
ESCAPE = """import os, sys, time
if os.environ.get("MS_ROLE") == "MS_WORKER":
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(sys.argv[1] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(sys.argv[1] + ".tmp", sys.argv[1])
            os.execve("/bin/sleep", ["sleep", "3600"], {})
        os._exit(0)
time.sleep(3600)
"""


def test_a_process_that_clears_its_environment_and_leaves_its_session_goes_with_its_job(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """Before: a generation's processes were found by a marker in their environment and by their
    ancestry, and a process that dropped both outlived its job. Now every process of a generation
    is in its cgroup, and `elasticctl stop` ends it with the job's others (cgroup.kill)."""
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"))
    pid_file = os.path.join(tmp, "escaped.pid")
    script = os.path.join(tmp, "escape.py")
    with open(script, "w") as f:
        f.write(ESCAPE)
    spec = lenet_spec(os.path.join(tmp, "a.toml"), "a", tmp, os.path.join(tmp, "ckpt"), 10, workers=1,
                      script=script, args=[pid_file], startup_timeout_s=600)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    wait_for("the escaped process", lambda: os.path.exists(pid_file), 60, 0.1)
    with open(pid_file) as f:
        pid = int(f.read())
    try:
        p = psutil.Process(pid)
        assert p.ppid() == 1 or p.ppid() != procs.started[0].pid  # (out of elasticd's tree)
        sid = os.getsid(pid)  # (a session whose leader, the middle child, exited: no group to kill)
        assert p.environ() == {} and not psutil.pid_exists(sid) or psutil.Process(sid).status() == "zombie", sid
        group = _cgroup_of(pid)
        assert "/mselastic-n0-" in group and "/a/gen-a.1.n0." in group, group  # (the generation's cgroup)
        r = elasticctl("stop", "a", endpoint=endpoint)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for("job a stopped", lambda: (s := etcd.status("a")) is not None and s.state.value == "STOPPED", 60, 0.2)
        wait_for("the escaped process gone", lambda: not psutil.pid_exists(pid) or
                 psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10, 0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    base = group.split("/a/", 1)[0]
    assert not os.path.exists(f"/sys/fs/cgroup/unified{base}/a"), "the job's cgroup is removed when it ends"


#: Job "bomb": its rank forks until the kernel refuses (each child sleeps), then waits; its count to
#: argv[1]. Job "hog": its rank takes memory 64 MiB at a time, each page written, until killed.
BOMB = """import os, sys, time
if os.environ.get("MS_ROLE") == "MS_WORKER":
    n = 0
    try:
        while n < 100000:
            if os.fork() == 0:
                time.sleep(3600)
                os._exit(0)
            n += 1
    except OSError as e:
        with open(sys.argv[1], "w") as f:
            f.write(f"{n} {e.errno}")
time.sleep(3600)
"""
HOG = """import os, time
if os.environ.get("MS_ROLE") == "MS_WORKER":
    held = []
    while True:
        held.append(bytearray(64 << 20))
        time.sleep(0.01)
time.sleep(3600)
"""


def test_a_fork_bomb_and_a_memory_hog_stay_in_their_jobs_limits(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """Before: jobs lived in elasticd's own cgroup, unbounded. Now each job has a cgroup with the
    spec's max_processes and memory_limit_mb: a fork bomb is refused at its limit and a memory hog
    is killed by the OOM killer inside its job (the failure says so), while another job trains
    and elasticd answers."""
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"), "--slots", "3")
    b = lenet_spec(os.path.join(tmp, "b.toml"), "b", os.path.join(tmp, "b-out"), os.path.join(tmp, "b-ckpt"), 1000,
                   workers=1)
    assert elasticctl("submit", b, endpoint=endpoint).returncode == 0
    wait_for("job b's first step", lambda: (r := etcd.report("b", 1, "n0")) and r.step >= 1, 120, 0.2)
    counted = os.path.join(tmp, "forks")
    for name, text, limits in (("bomb", BOMB, dict(max_processes=256)), ("hog", HOG, dict(memory_limit_mb=768))):
        with open(os.path.join(tmp, f"{name}.py"), "w") as f:
            f.write(text)
        spec = lenet_spec(os.path.join(tmp, f"{name}.toml"), name, tmp, os.path.join(tmp, f"{name}-ckpt"), 10,
                          workers=1, script=os.path.join(tmp, f"{name}.py"), args=[counted], startup_timeout_s=600,
                          max_restarts=0, **limits)
        assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    wait_for("the bomb refused", lambda: os.path.exists(counted) and os.path.getsize(counted) > 0, 60, 0.1)
    with open(counted) as f:
        forks, err = map(int, f.read().split())
    assert err == errno.EAGAIN and 100 < forks < 256, (forks, err)
    wait_for("the hog failed", lambda: (s := etcd.status("hog")) is not None and s.state.value == "FAILED", 120, 0.2)
    report = etcd.report("hog", 1, "n0")
    assert report is not None and "OOM killer" in report.reason and "768 MiB" in report.reason, report
    step = etcd.report("b", 1, "n0").step
    t0 = time.monotonic()
    r = elasticctl("jobs", endpoint=endpoint)
    took = time.monotonic() - t0
    assert r.returncode == 0 and "bomb" in r.stdout, r.stdout + r.stderr
    wait_for("job b training on", lambda: etcd.report("b", 1, "n0").step >= step + 5, 60, 0.2)
    assert elasticctl("stop", "bomb", endpoint=endpoint).returncode == 0
    bomb_group = [os.path.join(root, d, "bomb") for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
                  if os.path.isdir(root) for d in os.listdir(root) if d.startswith("mselastic-n0-")]
    assert bomb_group, "the bomb's cgroup"
    wait_for("every process of the bomb gone, its cgroup removed", lambda: not any(map(os.path.exists, bomb_group)),
             30, 0.1)
    assert procs.started[0].poll() is None
    print(f"bomb: {forks} forks, then EAGAIN; hog: {report.reason}; elasticctl jobs {took:.2f}s; b at step "
          f"{etcd.report('b', 1, 'n0').step}")
