"""A job can harm neither elasticd nor another job (issue #31): what a job puts in the folders it
controls never holds elasticd, whose reads of them are bounded, nor keeps it from stopping."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from typing import Any, Iterator

import psutil
import pytest

from mselastic.agent.containment import cgroups
from tests.harness import (Etcd, Processes, elasticctl, jobs_answer_s, lenet_spec, standby_processes, start_node,
                           wait_for, worker_pids)

pytestmark = pytest.mark.slow

#: The job's script: it makes its checkpoint_dir's latest.json a FIFO nobody writes, then never
#: reaches a step (elasticd, looking for the step it resumes from, reads that file).
PLANT = """import os, sys, time
path = os.path.join(sys.argv[1], "latest.json")
if os.environ.get("MS_ROLE") == "MS_WORKER" and not os.path.lexists(path):  # (msrun runs it as the scheduler too)
    os.mkfifo(path)
time.sleep(3600)
"""


def _files_that_would_hold_elasticd(procs: Processes, etcd: Etcd, endpoint: str, tmp: str) -> None:
    """Job a's own script plants a FIFO where elasticd reads a job's progress (then the test swaps
    in a link to /dev/zero and a 10 GiB sparse file): every `elasticctl jobs` still answers at
    once (before: 12 of 12 hung past 5 s, six threads stuck in open(); elasticd then outlived its
    SIGTERM by five minutes: the test's end checks that too), and a keeps its generation."""
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
        for _ in range(4):  # (timed first: a stall on the planted file would come at the first look)
            took.append(jobs_answer_s(endpoint))
            r = elasticctl("jobs", endpoint=endpoint)
            assert r.returncode == 0 and "RUNNING" in r.stdout, r.stdout + r.stderr
    assert max(took) < 1.0, [round(t, 2) for t in took]
    status = etcd.status("a")
    assert status is not None and status.generation == 1, status  # (the same generation all along)
    print(f"elasticctl jobs' Status call answered in at most {max(took):.2f}s beside a FIFO, a link to /dev/zero, a 10 GiB file")


def _job_cgroups(pid: int, job: str) -> list[str]:
    """The folders of ``job``'s cgroup in each hierarchy elasticd uses (v2; v1's memory and pids),
    from the cgroups of one of its processes, ``pid``."""
    with open("/proc/self/mountinfo") as f:
        v2, v1 = cgroups.mounts(f.read())
    with open(f"/proc/{pid}/cgroup") as f:
        theirs = cgroups.own(f.read())
    found = []
    for hierarchy, mount in (("", v2), ("memory", v1.get("memory", "")), ("pids", v1.get("pids", ""))):
        path = theirs.get(hierarchy, "")
        if mount and f"/{job}/" in path:
            found.append(os.path.join(mount, path.lstrip("/").split(f"/{job}/")[0], job))
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _standbys(procs: Processes) -> list[psutil.Process]:
    """The standbys and fork servers (not what the job's code left among them: see STRAY)."""
    found = []
    for p in standby_processes(procs):
        with contextlib.suppress(psutil.Error):
            if p.name() != "sleep":
                found.append(p)
    return found


def _fork_server(procs: Processes) -> list[psutil.Process]:
    """The job's fork server, once it has three standbys (the pool refilled)."""
    found = _standbys(procs)
    with contextlib.suppress(psutil.Error, IndexError):
        if len(found) >= 4:
            return [p for p in found if p.cmdline()[0] == "mselastic-standby-server"]
    return []


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
    sys.stdout.write("the rank's first line\\n")
    for _ in range(20):  # 20 MiB to its log, more than the cap the test gives elasticd
        sys.stdout.write(("x" * 1023 + "\\n") * 1024)
    sys.stdout.flush()
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
    is in its cgroup, and `elasticctl stop` ends it with the job's others (cgroup.kill). The rank
    also writes 20 MiB to its log, past the 4 MiB cap given: the log is rotated (its last 2 MiB
    kept as worker_0.log.1, its first MiB as worker_0.log.0) while the rank holds it open."""
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"), "--max-log-mb", "4")
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
        assert procs.started[0].pid not in {q.pid for q in p.parents()}  # (out of elasticd's tree)
        assert p.environ() == {}  # (no marker)
        sid = os.getsid(pid)  # (a session whose leader, the middle child, exited: no group to kill)
        assert sid != pid and (not psutil.pid_exists(sid) or psutil.Process(sid).status() == "zombie"), sid
        group = _cgroup_of(pid)
        assert "/mselastic-n0-" in group and "/a/gen-a.1.n0." in group, group  # (the generation's cgroup)
        job_groups = _job_cgroups(pid, "a")
        assert job_groups and all(map(os.path.isdir, job_groups)), job_groups
        log = os.path.join(tmp, "work", "logs", "a", "g000001", "worker_0.log")
        msrun_log = os.path.join(os.path.dirname(log), "msrun.log")  # (root's: emptied through elasticd's descriptor)
        wait_for("the rank's log rotated, msrun's (a copy of it) emptied", lambda: os.path.exists(log + ".1") and
                 os.stat(log).st_blocks * 512 <= 4 << 20 and os.stat(msrun_log).st_blocks * 512 <= 4 << 20, 30, 0.2)
        assert os.path.getsize(log + ".1") == 2 << 20 and os.path.getsize(log) < 4 << 20
        with open(log + ".0") as f:  # (its head, where a root cause usually is: kept at the first rotation)
            assert f.readline() == "the rank's first line\n" and os.path.getsize(log + ".0") == 1 << 20
        r = elasticctl("stop", "a", endpoint=endpoint)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for("job a stopped", lambda: (s := etcd.status("a")) is not None and s.state.value == "STOPPED", 60, 0.2)
        wait_for("the escaped process gone", lambda: not psutil.pid_exists(pid) or
                 psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10, 0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for("the job's cgroups removed", lambda: not any(map(os.path.exists, job_groups)), 10, 0.05)


def _node_training_b(procs: Processes, etcd: Etcd, namespace: str, tmp: str) -> str:
    """A node of 4 slots training job b (one rank, 1000 steps: beside the test's other jobs, all
    its run long); returns the node's endpoint once b made its first step."""
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"), "--slots", "4")
    b = lenet_spec(os.path.join(tmp, "b.toml"), "b", os.path.join(tmp, "b-out"), os.path.join(tmp, "b-ckpt"), 1000,
                   workers=1)
    assert elasticctl("submit", b, endpoint=endpoint).returncode == 0
    wait_for("job b's first step", lambda: (r := etcd.report("b", 1, "n0")) and r.step >= 1, 120, 0.2)
    return endpoint


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
            f.write(f"{n} {e.errno} {os.getpid()}")
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


def _a_fork_bomb_and_a_memory_hog(procs: Processes, etcd: Etcd, endpoint: str, tmp: str) -> None:
    """Before: jobs lived in elasticd's own cgroup, unbounded. Now each job has a cgroup with the
    spec's max_processes and memory_limit_mb: a fork bomb is refused at its limit and a memory hog
    is killed by the OOM killer inside its job (the failure says so), while b trains and elasticd
    answers."""
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
        forks, err, bomb_pid = map(int, f.read().split())
    assert err == errno.EAGAIN and 100 < forks < 256, (forks, err)
    bomb_group = _job_cgroups(bomb_pid, "bomb")
    assert bomb_group and all(map(os.path.isdir, bomb_group)), bomb_group
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
    wait_for("every process of the bomb gone, its cgroup removed", lambda: not any(map(os.path.exists, bomb_group)),
             30, 0.1)
    assert procs.started[0].poll() is None
    print(f"bomb: {forks} forks, then EAGAIN; hog: {report.reason}; elasticctl jobs {took:.2f}s; b at step "
          f"{etcd.report('b', 1, 'n0').step}")


#: Job a's rank: its "weights" in its checkpoint_dir, its pid where b can read it. Job b's rank: what
#: it can do to a (read a's file and environment, signal and trace its rank), to argv[2] as JSON.
ISOLATED = """import ctypes, json, os, sys, time
drop, ckpt = sys.argv[1], sys.argv[2]
if os.environ.get("MS_ROLE") == "MS_WORKER" and os.environ["MSELASTIC_JOB"] == "a":
    os.makedirs(ckpt, exist_ok=True)
    with open(os.path.join(ckpt, "weights.bin"), "w") as f:
        f.write("a's weights")
    with open(os.path.join(drop, "a.pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.chmod(os.path.join(drop, "a.pid.tmp"), 0o644)
    os.rename(os.path.join(drop, "a.pid.tmp"), os.path.join(drop, "a.pid"))
elif os.environ.get("MS_ROLE") == "MS_WORKER":
    while not os.path.exists(os.path.join(drop, "a.pid")):
        time.sleep(0.1)
    pid = int(open(os.path.join(drop, "a.pid")).read())
    tried = {"uid": os.getuid(), "groups": os.getgroups()}
    for what, act in (("read", lambda: open(os.path.join(drop, "a-ckpt", "weights.bin")).read()),
                      ("environ", lambda: open(f"/proc/{pid}/environ", "rb").read()),
                      ("signal", lambda: os.kill(pid, 0))):
        try:
            act()
            tried[what] = "allowed"
        except OSError as e:
            tried[what] = e.errno
    libc = ctypes.CDLL(None, use_errno=True)
    tried["ptrace"] = "allowed" if libc.ptrace(16, pid, None, None) == 0 else ctypes.get_errno()  # PTRACE_ATTACH
    with open(os.path.join(drop, "b.json.tmp"), "w") as f:
        json.dump(tried, f)
    os.chmod(os.path.join(drop, "b.json.tmp"), 0o644)
    os.rename(os.path.join(drop, "b.json.tmp"), os.path.join(drop, "b.json"))
time.sleep(3600)
"""


def test_with_job_uids_one_job_can_neither_read_nor_signal_nor_trace_another(
        procs: Processes, etcd: Etcd, namespace: str, shared_tmp: str, python_for_nobody: None) -> None:
    """Before: every job ran as the one worker user, and job b read a's checkpoint and signalled its
    rank. With job_uids each job runs as a uid of its own (allocated at submit, kept by its name
    across a delete): b's attempts on a's checkpoint, environment and rank are all refused."""
    drop = os.path.join(shared_tmp, "drop")
    os.makedirs(drop)
    os.chmod(drop, 0o1777)  # (the jobs' checkpoint_dirs are made by their own uids, as on shared storage)
    endpoint = start_node(procs, etcd, namespace, os.path.join(shared_tmp, "work"), "--job-uids", "62100-62109",
                          "--slots", "3")
    script = os.path.join(shared_tmp, "isolated.py")
    with open(script, "w") as f:
        f.write(ISOLATED)
    os.chmod(script, 0o644)
    for name in ("a", "b"):
        spec = lenet_spec(os.path.join(shared_tmp, f"{name}.toml"), name, drop, os.path.join(drop, f"{name}-ckpt"), 10,
                          workers=1, script=script, args=[drop, os.path.join(drop, f"{name}-ckpt")],
                          startup_timeout_s=600)
        r = elasticctl("submit", spec, endpoint=endpoint)
        assert r.returncode == 0, r.stdout + r.stderr
    wait_for("b's attempts on a", lambda: os.path.exists(os.path.join(drop, "b.json")), 90, 0.2)
    with open(os.path.join(drop, "b.json")) as f:
        tried = json.load(f)
    with open(os.path.join(drop, "a.pid")) as f:
        a_pid = int(f.read())
    a_uid = psutil.Process(a_pid).uids().real
    assert a_uid in range(62100, 62110) and tried["uid"] in range(62100, 62110) and a_uid != tried["uid"], tried
    assert os.stat(os.path.join(drop, "a-ckpt", "weights.bin")).st_uid == a_uid
    assert 0 not in tried["groups"], tried  # (the worker user here is root: its group is never given)
    assert (tried["read"], tried["environ"], tried["signal"], tried["ptrace"]) == \
        (errno.EACCES, errno.EACCES, errno.EPERM, errno.EPERM), tried
    assert etcd.get(etcd.keys.job_uid("a")) == str(a_uid).encode()
    # The uid stays the name's: deleted and submitted again, a gets it back (its files are that uid's).
    for cmd in (("stop", "a"), ("delete", "a")):
        wait_for(f"elasticctl {' '.join(cmd)}", lambda: elasticctl(*cmd, endpoint=endpoint).returncode == 0, 60, 0.5)
    assert elasticctl("submit", os.path.join(shared_tmp, "a.toml"), endpoint=endpoint).returncode == 0
    assert etcd.get(etcd.keys.job_uid("a")) == str(a_uid).encode()
    print(f"a ran as uid {a_uid}, b as {tried['uid']}; b's attempts: {tried}")


#: A job's own code in its fork server (a sitecustomize on the PYTHONPATH an admin allowed): it
#: leaves a process behind there, detached (a session of its own, its parent gone), named in STRAY_DIR.
STRAY = """import os, sys
if "mselastic.trainer.standby" in sys.orig_argv and os.environ.get("STRAY_DIR"):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            open(os.path.join(os.environ["STRAY_DIR"], str(os.getpid())), "w").close()
            os.execv("/bin/sleep", ["sleep", "1000"])
        os._exit(0)
    os.wait()
"""

#: Another local user's flood: as many datagrams as it can send to the path in argv[1] for argv[2]
#: seconds; prints how many went through and the errors it got.
FLOOD = """import collections, socket, sys, time
path, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
sent, errors = 0, collections.Counter()
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    while time.monotonic() < until:
        try:
            s.sendto(b'{"kind": "step", "rank": 0, "step": 999999}', path)
            sent += 1
        except OSError as e:
            errors[e.errno] += 1
print(sent, dict(errors))
"""


def test_another_local_users_heartbeat_flood_never_reaches_a_jobs_socket_and_a_warm_relaunch_runs_as_the_job(
        procs: Processes, etcd: Etcd, namespace: str, shared_tmp: str, python_for_nobody: None) -> None:
    """Before: the heartbeat socket had an abstract name anyone could send to, and a flood filled its
    queue, dropping the ranks' own beats. Now it is a file in elasticd's folder (0711), the
    generation's user's, mode 0600: nobody (uid 65534) gets EACCES for every datagram while the job
    trains. The job runs as its uid of job_uids with standbys (the production default, which the
    suite otherwise runs as root): a rank killed from outside is relaunched warm, its standbys and
    ranks of the job's uid, and the relaunches are the ones for the test's kills (no false verdict).
    The job's code in its fork server leaves a detached process there: once that server is killed
    (as the OOM killer would) and replaced, the process goes with it, while the job trains on."""
    job_uid = 62400  # (the first of the range: the namespace is new)
    out, drop = os.path.join(shared_tmp, "out"), os.path.join(shared_tmp, "drop")
    os.makedirs(out)
    os.chown(out, job_uid, -1)
    strays, site = os.path.join(drop, "strays"), os.path.join(shared_tmp, "site")
    for folder in (drop, strays):
        os.makedirs(folder)
        os.chmod(folder, 0o1777)
    os.makedirs(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(STRAY)
    os.chmod(site, 0o755)
    endpoint = start_node(procs, etcd, namespace, os.path.join(shared_tmp, "work"), "--job-uids", "62400-62409",
                          "--allow-env", "PYTHONPATH", warm=True)
    spec = lenet_spec(os.path.join(shared_tmp, "a.toml"), "lenet", out, os.path.join(drop, "ckpt"), 60, workers=2,
                      hang_timeout_s=10, snapshot_interval_steps=1, env={"PYTHONPATH": site, "STRAY_DIR": strays})
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    flood = os.path.join(shared_tmp, "flood.py")
    with open(flood, "w") as f:
        f.write(FLOOD)
    os.chmod(flood, 0o644)
    floods = []
    for generation in (1, 2):
        wait_for(f"generation {generation} training",
                 lambda: (r := etcd.report("lenet", generation, "n0")) and r.step >= 1, 120, 0.1)
        ranks = worker_pids(procs, generation)
        path = psutil.Process(ranks[0]).environ()["MSELASTIC_HEARTBEAT"]
        assert path.startswith("/run/mselastic/hb/"), path
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == job_uid, st
        assert {psutil.Process(pid).uids().real for pid in ranks.values()} == {job_uid}
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, flood,
                            path, "3"], capture_output=True, text=True, timeout=60, cwd="/")
        sent, errors = r.stdout.split(" ", 1)
        assert r.returncode == 0 and int(sent) == 0 and str(errno.EACCES) in errors, r.stdout + r.stderr
        floods.append(errors.strip())
        if generation == 1:
            ready = wait_for("three standbys", lambda: len(x := [s for s in _standbys(procs)]) >= 4 and x,
                             120, 0.2)  # (three and their fork server)
            assert {p.uids().real for p in ready} == {job_uid}
            titles = sorted([a for a in p.cmdline() if a] for p in ready)  # (what ps shows: what each one is)
            assert titles == [["mselastic-standby", "lenet", "(idle)"]] * 3 + [["mselastic-standby-server", "lenet"]], \
                titles
            os.kill(ranks[1], signal.SIGKILL)
        else:
            titles = {r: [a for a in psutil.Process(pid).cmdline() if a][:3] for r, pid in ranks.items()}
            assert titles == {r: ["python", f"mselastic:lenet:g2:rank{r}", "train.py"] for r in ranks}, titles
    assert etcd.report("lenet", 2, "n0").warm  # (its ranks are the standbys, of the job's uid: checked above)
    # The fork server killed: its standbys die with it, and generation 2's ranks (forked by it,
    # they die with it too); the relaunch starts cold, and its pool starts another server; the
    # first server's cgroup goes, with what the job left there.
    first = [int(n) for n in os.listdir(strays)]
    assert len(first) == 1 and psutil.pid_exists(first[0]) and _cgroup_of(first[0]).rsplit("/", 1)[1].startswith(
        "pool-"), first
    wait_for("the refilled pool", lambda: _fork_server(procs), 120, 0.2)[0].kill()
    wait_for("the standbys gone with their server", lambda: not _standbys(procs), 10, 0.05)
    wait_for("generation 3 training", lambda: (r := etcd.report("lenet", 3, "n0")) and r.step >= 1, 120, 0.1)
    assert not etcd.report("lenet", 3, "n0").warm
    wait_for("the first server's stray gone", lambda: not _alive(first[0]), 30, 0.1)
    second = wait_for("the second server's stray", lambda: [int(n) for n in os.listdir(strays) if int(n) != first[0]],
                      60, 0.1)
    assert etcd.status("lenet").state.value == "RUNNING" and _alive(second[0]), second  # (only the ended server's)
    wait_for("the job done", lambda: (s := etcd.status("lenet")) is not None and s.state.value == "SUCCEEDED", 120, 0.2)
    assert etcd.status("lenet").generation == 3  # (the relaunches for the test's two kills, and no other)
    wait_for("the second stray gone with its job", lambda: not _alive(second[0]), 30, 0.1)
    print(f"nobody's floods (3 s each, generations 1 and 2): errors {floods}")


@contextlib.contextmanager
def hung_mount(path: str) -> Iterator[None]:
    """A file system at ``path`` whose server never answers (a FUSE mount nobody serves: the stand-in
    for an NFS server that stopped); every access below it waits, until the server's end is
    closed on the way out (the waits then fail with ENOTCONN) and the mount detached."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    try:
        if libc.mount(b"mselastic-hung", path.encode(), b"fuse", 0,
                      f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()) != 0:
            pytest.skip(f"cannot mount a FUSE file system here: {os.strerror(ctypes.get_errno())}")
        yield
    finally:
        os.close(fd)
        libc.umount2(path.encode(), 2)  # MNT_DETACH


def _storage_that_stops_answering(procs: Processes, etcd: Etcd, endpoint: str, tmp: str) -> None:
    """Before: a launch's checks of shared storage ran on the event loop, and a hung mount stalled it
    past the lease and systemd's watchdog. Now they run in a bounded thread: with job nfs's
    checkpoint_dir on storage that never answers, its launch fails after a third of its
    startup_timeout_s saying so, while the node stays registered on the same lease, elasticctl
    answers and job b trains."""

    async def registration(store: Any) -> tuple[int, int]:
        kv = await store.get(etcd.keys.node("n0"))
        return kv.lease, kv.create_revision

    registered = etcd._run(registration)
    mount = os.path.join(tmp, "nfs")
    os.makedirs(mount)
    with hung_mount(mount):
        spec = lenet_spec(os.path.join(tmp, "nfs.toml"), "nfs", os.path.join(tmp, "nfs-out"),
                          os.path.join(mount, "ckpt"), 10, workers=1, startup_timeout_s=15, max_restarts=0)
        t0 = time.monotonic()
        r = elasticctl("submit", spec, "--force", endpoint=endpoint)
        assert r.returncode == 0, r.stdout + r.stderr
        submitted = time.monotonic() - t0
        failed = wait_for("nfs's launch failed",
                          lambda: (rep := etcd.report("nfs", 1, "n0")) and rep.state.terminal and rep, 60, 0.2)
        assert failed.state.value == "FAILED" and "did not finish within 5s (storage not answering" in failed.reason, \
            failed
        step = etcd.report("b", 1, "n0").step
        took = []
        for _ in range(3):  # (nfs's step is read from its hung checkpoint_dir: a poll does not wait for it)
            took.append(jobs_answer_s(endpoint))
            assert elasticctl("jobs", endpoint=endpoint).returncode == 0
        assert max(took) < 1.0, [round(t, 2) for t in took]
        wait_for("job b training on", lambda: etcd.report("b", 1, "n0").step >= step + 3, 60, 0.2)
        assert etcd._run(registration) == registered  # (the same lease all along: never expired, never re-made)
    print(f"submit took {submitted:.2f}s; nfs failed: {failed.reason}; elasticctl jobs' Status call answered in at most {max(took):.2f}s")


def test_hostile_jobs_harm_neither_elasticd_nor_the_job_training_beside_them(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """One node trains job b all along; beside it, one after the other, jobs that would have held
    or starved elasticd or b before #31 (each part says what it shows, and what was seen before):
    files in a job's folder that block or never end, a fork bomb and a memory hog, storage that
    stops answering during a launch. At the end a SIGINT stops elasticd and b, exit 0, within its
    grace (before: alive five minutes after it, threads stuck on a job's FIFO)."""
    tmp = str(tmp_path)
    endpoint = _node_training_b(procs, etcd, namespace, tmp)
    _files_that_would_hold_elasticd(procs, etcd, endpoint, tmp)
    _a_fork_bomb_and_a_memory_hog(procs, etcd, endpoint, tmp)
    _storage_that_stops_answering(procs, etcd, endpoint, tmp)
    elasticd = procs.started[0]
    t0 = time.monotonic()
    elasticd.send_signal(signal.SIGINT)
    assert elasticd.wait(30) == 0
    print(f"elasticd stopped {time.monotonic() - t0:.1f}s after SIGINT")
