"""A job can harm neither elasticd nor another job (issue #31): what a job puts in the folders it
controls never holds elasticd, whose reads of them are bounded, nor keeps it from stopping."""

from __future__ import annotations

import os
import signal
import stat
import time

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
