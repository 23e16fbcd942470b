"""Devices as the slots (issue #32): a node with a configured inventory gives the ranks of two jobs
disjoint devices, and a job's relaunch the same ones. What each rank was launched with is read
from outside, in its /proc/PID/environ: the visible-devices variable and msrun's DEVICE_ID."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.harness import (Etcd, Processes, elasticctl, generation_processes, lenet_spec, standby_processes,
                           start_node, wait_for)

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
    for job in ("a", "b"):
        spec = lenet_spec(os.path.join(tmp, f"{job}.toml"), job, os.path.join(tmp, job), os.path.join(tmp, f"{job}-ckpt"),
                          40, workers=2)
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
    rows = {tuple(line.split()) for line in nodes.stdout.splitlines()}
    a_devices = sorted(map(int, ids["a"]))
    assert {("n0", str(d), "gpu", "a", str(r)) for r, d in enumerate(a_devices)} <= rows, nodes.stdout
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
