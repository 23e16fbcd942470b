"""Devices as the slots (issue #32): a node with a configured inventory gives the ranks of two jobs
disjoint devices, and a job's relaunch the same ones. What each rank was launched with is read
from outside, in its /proc/PID/environ: the visible-devices variable and msrun's DEVICE_ID."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import psutil
import pytest

from mselastic.agent.devices.health import DeviceHealth
from mselastic.core.model import DeviceCordon, NodeRecord
from mselastic.store.embedded import free_port
from tests.harness import (LENET, Etcd, Processes, elasticctl, elasticd_cmd, generation_processes, lenet_spec,
                           local_socket, standby_processes, start_node, wait_for)

pytestmark = pytest.mark.slow


def _launched(procs: Processes, job: str, generation: int) -> dict[int, tuple[str, str, int]]:
    """rank -> (CUDA_VISIBLE_DEVICES, DEVICE_ID, pid) of each worker of a generation, as the kernel
    holds its environment."""
    found = {}
    for p in generation_processes(procs, generation, job):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("MS_ROLE") == "MS_WORKER":
            assert env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID", env  # (nvidia-smi's numbering, NVML's)
            found[int(env["RANK_ID"])] = (env.get("CUDA_VISIBLE_DEVICES", ""), env.get("DEVICE_ID", ""), p.pid)
    return found


def _standbys(procs: Processes, job: str) -> dict[int, str]:
    """pid -> CUDA_VISIBLE_DEVICES of ``job``'s standbys and fork server."""
    found = {}
    for p in standby_processes(procs):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("MSELASTIC_RUN_ID", "").startswith(f"standby.{job}."):
            found[p.pid] = env.get("CUDA_VISIBLE_DEVICES", "")
    return found


def test_two_jobs_on_one_node_train_on_disjoint_devices_and_a_relaunch_keeps_them(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """Node n0 lists gpu devices 0-3 (4 slots). Jobs a and b, two ranks each, are launched with
    CUDA_VISIBLE_DEVICES naming two devices each, none in both, and DEVICE_ID 0 and 1 (msrun's
    local rank: the first and second of those); a's rank killed, its warm relaunch is launched with
    the same devices; elasticctl nodes says which job and rank uses each device."""
    tmp = str(tmp_path)
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"), "--devices", "0-3", "--slots", "4",
                          "--device-kind", "gpu", warm=True)
    for job, steps in (("a", 40), ("b", 16)):  # (b: long enough to hold its devices while a's are read)
        spec = lenet_spec(os.path.join(tmp, f"{job}.toml"), job, os.path.join(tmp, job), os.path.join(tmp, f"{job}-ckpt"),
                          steps, workers=2)
        r = elasticctl("submit", spec, endpoint=endpoint)
        assert r.returncode == 0, r.stdout + r.stderr
    seen = {job: wait_for(f"{job}'s two ranks", lambda job=job: len(x := _launched(procs, job, 1)) == 2 and x, 120,
                          0.1) for job in ("a", "b")}
    visible = {job: {v for v, _, _ in ranks.values()} for job, ranks in seen.items()}
    assert all(len(v) == 1 for v in visible.values()), visible  # (one list per job and node)
    ids = {job: set(next(iter(v)).split(",")) for job, v in visible.items()}
    assert ids["a"].isdisjoint(ids["b"]) and ids["a"] | ids["b"] == {"0", "1", "2", "3"}, ids
    assert {job: sorted(d for _, d, _ in ranks.values()) for job, ranks in seen.items()} == \
        {"a": ["0", "1"], "b": ["0", "1"]}
    nodes = elasticctl("nodes", endpoint=endpoint)
    assert nodes.returncode == 0, nodes.stderr
    rows = {tuple(line.split()[:6]) for line in nodes.stdout.splitlines()}
    a_devices = sorted(map(int, ids["a"]))
    assert {("n0", str(d), "gpu", "a", str(r), "healthy") for r, d in enumerate(a_devices)} <= rows, nodes.stdout
    print(nodes.stdout)

    standbys = wait_for("a's standbys", lambda: len(x := _standbys(procs, "a")) >= 4 and x, 120, 0.2)
    assert set(standbys.values()) == visible["a"], standbys  # (started with a's devices: its relaunch's)
    os.kill(seen["a"][1][2], signal.SIGKILL)
    again = wait_for("a's relaunch", lambda: len(x := _launched(procs, "a", 2)) == 2 and x, 120, 0.1)
    assert {r: (v, d) for r, (v, d, _) in again.items()} == {r: (v, d) for r, (v, d, _) in seen["a"].items()}
    assert etcd.report("a", 2, "n0").warm and {pid for _, _, pid in again.values()} <= set(standbys)
    for job in ("a", "b"):
        wait_for(f"{job} done", lambda job=job: (s := etcd.status(job)) is not None and s.state.value == "SUCCEEDED",
                 180, 0.2)
    print(f"a: {sorted(seen['a'].items())}, relaunched {'warm' if etcd.report('a', 2, 'n0').warm else 'cold'}: "
          f"{sorted(again.items())}; b: {sorted(seen['b'].items())}")


#: The example job, except that rank 1 of generation 1 meets a device error once it trains (its
#: first checkpoint written): it writes what CUDA says of an uncorrectable ECC error to its log
#: (its standard error, which msrun puts there) and exits.
ECC = """import os, runpy, sys, threading, time
def ecc():
    while not os.path.exists(os.path.join(os.environ["MSELASTIC_CHECKPOINT_DIR"], "latest.json")):
        time.sleep(0.05)
    print("RuntimeError: CUDA error: uncorrectable ECC error encountered", file=sys.stderr, flush=True)
    os._exit(1)
if os.environ["MSELASTIC_GENERATION"] == "1" and os.environ["RANK_ID"] == "1":
    threading.Thread(target=ecc, daemon=True).start()
sys.argv[0] = {lenet!r}
runpy.run_path({lenet!r}, run_name="__main__")
"""


def test_a_device_a_failed_ranks_log_names_is_set_aside_and_the_node_serves_on_with_the_others(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """Node n0 lists gpu devices 0-3 and checks each before a generation uses it (a device check
    that device 2 fails). Job a's rank 1 (on device 1) writes a CUDA uncorrectable ECC error to its
    log and exits: device 1 is set aside (elasticctl nodes says why); generation 2 gets devices 0
    and 2, and device 2 fails its check: set aside too, the launch failed; generation 3 is launched
    on devices 0 and 3 (read from its ranks' environment) and the job finishes. The node is not
    blamed (no failure counted, no quarantine). elasticctl uncordon n0 --device 1 puts 1 back."""
    tmp = str(tmp_path)
    check = 'if [ "$CUDA_VISIBLE_DEVICES" = 2 ]; then echo "HBM test failed on $CUDA_VISIBLE_DEVICES"; exit 3; fi'
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"), "--devices", "0-3", "--slots", "4",
                          "--device-kind", "gpu", "--device-cooldown-s", "0", "--device-check", check,
                          "--device-check-every-generation", "true")
    script = os.path.join(tmp, "ecc.py")
    with open(script, "w") as f:
        f.write(ECC.format(lenet=LENET))
    spec = lenet_spec(os.path.join(tmp, "a.toml"), "a", os.path.join(tmp, "a"), os.path.join(tmp, "ckpt"), 30,
                      workers=2, script=script, checkpoint_interval_steps=5)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    first = wait_for("generation 1's report", lambda: (r := etcd.report("a", 1, "n0")) and r.state.terminal and r, 120,
                     0.1)
    assert first.cause.value == "DEVICE" and first.failed_device == 1 and first.devices == (0, 1), first
    assert "uncorrectable ECC" in first.reason and "set aside" in first.reason, first.reason
    checked = wait_for("generation 2's report", lambda: (r := etcd.report("a", 2, "n0")) and r.state.terminal and r,
                       60, 0.1)
    assert checked.cause.value == "DEVICE" and checked.failed_device == 2 and checked.devices == (0, 2), checked
    assert checked.reason == "gpu device 2 failed its check (exit code 3: HBM test failed on 2); set aside", checked
    again = wait_for("generation 3's ranks", lambda: len(x := _launched(procs, "a", 3)) == 2 and x, 120, 0.1)
    assert {r: (v, d) for r, (v, d, _) in again.items()} == {0: ("0,3", "0"), 1: ("0,3", "1")}, again
    status = etcd.status("a")
    assert status is not None and not status.node_failures and not status.quarantined_until, status
    nodes = elasticctl("nodes", endpoint=endpoint).stdout
    row = next(line for line in nodes.splitlines() if line.split()[:2] == ["n0", "1"])
    assert "unhealthy since" in row and "until uncordoned" in row and "job a:" in row and "ECC" in row, nodes
    print(nodes)
    described = elasticctl("describe", "node", "n0", endpoint=endpoint).stdout
    assert row in described.splitlines() and "device check failed: exit code 3" in described, described
    missing = elasticctl("describe", "node", "n9", endpoint=endpoint)
    assert missing.returncode == 1 and "no node named 'n9' is registered" in missing.stderr, missing.stderr
    wait_for("a done", lambda: (s := etcd.status("a")) is not None and s.state.value == "SUCCEEDED", 180, 0.2)
    r = elasticctl("uncordon", "n0", "--device", "1", endpoint=endpoint)
    assert r.returncode == 0 and "device 1 uncordoned" in r.stdout, r.stdout + r.stderr
    rows = [line.split() for line in elasticctl("nodes", endpoint=endpoint).stdout.splitlines()]
    assert [r[5] for r in rows if r[:2] == ["n0", "1"]] == ["healthy"], rows
    r = elasticctl("uncordon", "n0", "--device", "7", endpoint=endpoint)
    assert r.returncode != 0 and "node n0 has no device 7 (its devices: 0-3)" in r.stderr, r.stderr


#: nvidia-ml-py's pynvml as a machine without NVIDIA's driver can have it (see its notes).
FAKE_NVML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fake_nvml")
#: An nvidia-smi that shows the GPUs its folder's file "gpus" names (the node's tool, as elasticd
#: finds it on its PATH; a GPU that falls off the bus is one the file no longer names).
FAKE_SMI = """#!/bin/sh
[ "$1" = "-L" ] || exit 2
if [ "$(cat "$(dirname "$0")/gpus")" = fail ]; then echo "Failed to initialize NVML: Driver/library version mismatch"; exit 9; fi
for i in $(cat "$(dirname "$0")/gpus"); do
    echo "GPU $i: NVIDIA H200 (UUID: GPU-$i$i$i$i$i$i$i$i-0000-0000-0000-000000000000)"
done
"""


def test_the_devices_detected_are_registered_and_a_list_they_contradict_is_refused(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """With an nvidia-smi on its PATH that shows GPUs 0-2: devices = auto registers gpu 0-2 (3 slots);
    devices = 0-3 is refused at start, saying what the tool shows (one line, exit 2). The tool then
    fails for a while (NVML's driver/library mismatch): nothing is set aside. Then GPU 1 is gone
    from what the tool shows: it is set aside until uncordoned, and elasticctl nodes says why.
    NVML (tests/fake_nvml, on elasticd's PYTHONPATH) then reports Xid 13 on GPU 2 (a job's fault:
    nothing set aside) and Xid 79 on GPU 0: set aside for device_cooldown_s, for no job."""
    tmp = str(tmp_path)
    tools = os.path.join(tmp, "bin")
    os.makedirs(tools)
    with open(os.path.join(tools, "nvidia-smi"), "w") as f:
        f.write(FAKE_SMI)
    with open(os.path.join(tools, "gpus"), "w") as f:
        f.write("0 1 2\n")
    os.chmod(os.path.join(tools, "nvidia-smi"), 0o755)
    path = tools + os.pathsep + os.environ.get("PATH", "")
    cmd = elasticd_cmd("n0", etcd.endpoint, free_port(), os.path.join(tmp, "work"), namespace)
    refused = subprocess.run([*cmd, "--devices", "0-3", "--device-kind", "gpu", "--slots", "4"], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, PATH=path))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "elasticd: devices: 0-3, but nvidia-smi -L shows gpu devices 0-2 here: list those, or devices = auto"), \
        refused.stderr
    procs.start("elasticd-n0", [*cmd, "--devices", "auto", "--slots", "1", "--device-detect-interval-s", "0.5"],
                env={"PATH": path, "PYTHONPATH": FAKE_NVML, "FAKE_NVML_DIR": tools})
    node = wait_for("n0 registered", lambda: (raw := etcd.get(etcd.keys.node("n0"))) and NodeRecord.from_json(raw),
                    30, 0.1)
    assert (node.device_kind, node.devices, node.slots) == ("gpu", (0, 1, 2), 3), node
    with open(os.path.join(tools, "gpus"), "w") as f:
        f.write("fail")
    time.sleep(2.0)  # (four looks)
    assert not [d for d in (0, 1, 2) if etcd.get(etcd.keys.device_cordon("n0", d))]
    with open(os.path.join(tools, "gpus"), "w") as f:
        f.write("0 2\n")
    aside = wait_for("GPU 1 set aside", lambda: (raw := etcd.get(etcd.keys.device_cordon("n0", 1))) and
                     DeviceCordon.from_json(raw), 10, 0.1)
    assert aside.until == 0 and aside.reason == "gone from nvidia-smi -L (it shows 0,2)", aside
    assert etcd.get(etcd.keys.device_cordon("n0", 0)) is None and etcd.get(etcd.keys.device_cordon("n0", 2)) is None
    rows = [line.split(None, 5) for line in elasticctl("nodes", endpoint="unix:" + local_socket(
        os.path.join(tmp, "work"))).stdout.splitlines()]
    assert [r[5] for r in rows if r[:2] == ["n0", "1"]] == [
        f"unhealthy since {time.strftime('%H:%M:%S', time.localtime(aside.since))} until uncordoned: "
        f"gone from nvidia-smi -L (it shows 0,2)"], rows
    # NVML reports a job's fault (Xid 13) on GPU 2, then a GPU's own (79: fallen off the bus) on 0.
    with open(os.path.join(tools, "xids"), "w") as f:
        f.write("2 13\n0 79\n")
    xid = wait_for("GPU 0 set aside", lambda: (raw := etcd.get(etcd.keys.device_cordon("n0", 0))) and
                   DeviceCordon.from_json(raw), 10, 0.1)
    assert xid.reason == "Xid 79 reported by NVML" and xid.until == pytest.approx(xid.since + 1800) and not xid.job, xid
    assert etcd.get(etcd.keys.device_cordon("n0", 2)) is None


def test_one_job_holds_at_most_two_devices_of_a_node_aside_and_a_stronger_cordon_is_kept(etcd: Etcd) -> None:
    """The set-aside rule against the real etcd (no processes): a job's log lines set aside at most
    two devices of a node at once (counted from etcd: an elasticd restarted counts the same);
    another job's count is its own; a device aside for good (gone, an operator's) stays so when a
    job's rank later names it. A hardware Xid from NVML sets its GPU aside for no job, and blames
    it for a rank that fails on it even when the job is at its cap; another Xid counts against the
    job using the GPU."""

    async def run(store: Any) -> list[Any]:
        health = DeviceHealth(store, "n0", 1800.0)
        gone = DeviceCordon("n0", 5, "gone from nvidia-smi -L (it shows 0-4)", time.time())
        await store.put(store.keys.device_cordon("n0", 5), gone.to_json())
        results = [await health.set_aside("x", d, "uncorrectable ECC error") for d in (0, 1, 2)]
        restarted = DeviceHealth(store, "n0", 1800.0)
        results += [await restarted.set_aside("x", 3, "uncorrectable ECC error"),
                    await restarted.set_aside("y", 3, "uncorrectable ECC error"),
                    await restarted.set_aside("y", 5, "GPU has fallen off the bus")]
        kept = DeviceCordon.from_json((await store.get(store.keys.device_cordon("n0", 5))).value)
        # x, at its cap, has ranks on GPUs 4 and 6. NVML reports a hardware Xid (79) on 6: not x's
        # doing, set aside for no job, and a rank failing there fails for it; an Xid that is not
        # the hardware's alone (8) on 4 counts against x: not set aside.
        nvml = DeviceHealth(store, "n0", 1800.0, user_of=lambda device: "x")
        await nvml.xid(6, 79)
        await nvml.xid(4, 8)
        evidence = [await nvml.blame("x", 6, ""), await nvml.blame("x", 4, ""), await nvml.blame("x", 7, ""),
                    await nvml.blame("x", 7, "uncorrectable ECC error")]
        xid = DeviceCordon.from_json((await store.get(store.keys.device_cordon("n0", 6))).value)
        # GPU 6 then gone from the tools (for good): still the Xid's evidence; a job's later log
        # line about it charges no job; once uncordoned, no evidence.
        await nvml._aside(DeviceCordon("n0", 6, "gone from nvidia-smi -L (it shows 0-5)", time.time()))
        evidence.append(await nvml.blame("x", 6, ""))
        await store.delete(store.keys.device_cordon("n0", 6))
        evidence.append(await nvml.blame("x", 6, ""))
        await nvml.xid(8, 79)
        await nvml.blame("y", 8, "")
        await nvml._aside(DeviceCordon("n0", 8, "job y: uncorrectable ECC error", time.time(), time.time() + 3600, "y"))
        eight = DeviceCordon.from_json((await store.get(store.keys.device_cordon("n0", 8))).value)
        return [results, kept, evidence, xid, await store.get(store.keys.device_cordon("n0", 4)), eight]

    results, kept, evidence, xid, four, eight = etcd._run(run)
    assert results == [True, True, False, False, True, True], results
    assert kept.until == 0 and kept.job == "" and kept.reason.startswith("gone from"), kept
    assert evidence[0].startswith("NVML reported Xid 79 on it at ") and evidence[1:4] == ["", "", ""], evidence
    assert evidence[4] == evidence[0] and evidence[5] == "", evidence
    assert four is None and eight.job == "" and "ECC" in eight.reason, eight
    assert xid.reason == "Xid 79 reported by NVML" and xid.job == "" and xid.until == pytest.approx(xid.since + 1800), xid
