"""The generation's shim (mselastic.agent.shim) as elasticd starts it: a real process, a real
deadline file on CLOCK_BOOTTIME, real processes of a "generation" (found by their marker, in their
own session as msrun's workers are) and real signals. The cluster tests show it under a frozen
elasticd (tests/integration/test_split_brain.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from mselastic.agent import shim
from mselastic.core import fencing
from mselastic.core.contract import ENV_RUN_ID
from tests.harness import Processes, holds_for, wait_for

MARKER = "lenet.1.n0.shimtest"


def generation(procs: Processes, tmp: str) -> tuple[shim.Paths, psutil.Process]:
    """A rank of a generation (a sleeping process with the generation's marker) and the shim's files."""
    rank = procs.start("rank", [sys.executable, "-c", "import time; time.sleep(600)"], env={ENV_RUN_ID: MARKER})
    paths = shim.Paths(os.path.join(tmp, "g000001"))
    record = shim.Record("lenet", 1, "n0", [MARKER], ttl_s=3.0)
    shim.write_atomically(paths.record, record.to_json())
    return paths, psutil.Process(rank.pid)


def start_shim(procs: Processes, paths: shim.Paths) -> subprocess.Popen[bytes]:
    return procs.start("shim", [sys.executable, "-m", "mselastic.agent.shim", paths.record])


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
