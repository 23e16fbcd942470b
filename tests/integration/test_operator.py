"""The operator's surface against a real running cluster: elasticctl's every command and
output format, its errors and exit codes, `watch` in a real pseudo-terminal, the timeline
PNG of a real run, and the metrics endpoint scraped across a rank kill.

One job runs for the whole module: LeNet on one node (2 ranks), rank 1 SIGKILLed at step
20 of generation 1 (generation 2 recovers), then `elasticctl restart` (generation 3,
planned). The tests run in file order against it.
"""

from __future__ import annotations

import json
import os
import re
import select
import struct
import subprocess
import sys
import urllib.request
import uuid
import zlib
from typing import Iterator

import pexpect
import pytest
import yaml

from mselastic.core.states import JobState
from mselastic.store.embedded import EmbeddedEtcd, free_port
from tests.harness import DATA_DIR, VENV_BIN, Etcd, Processes, elasticctl, lenet_spec, start_node, wait_for

# (The tests run in file order against the module's one job, on one worker: tests/conftest.py, ONE_WORKER.)
pytestmark = pytest.mark.slow
JOB, TOTAL = "lenet", 60


class Run:
    def __init__(self, endpoint: str, metrics: str, etcd: Etcd, tmp: str) -> None:
        self.endpoint, self.metrics, self.etcd, self.tmp = endpoint, metrics, etcd, tmp

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return elasticctl(*args, endpoint=self.endpoint)


@pytest.fixture(scope="module")
def run(etcd_server: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = str(tmp_path_factory.mktemp("operator"))
    procs = Processes(uuid.uuid4().hex, tmp)
    etcd = Etcd(etcd_server.endpoint, f"/t-{uuid.uuid4().hex[:10]}")
    metrics = f"127.0.0.1:{free_port()}"
    try:
        endpoint = start_node(procs, etcd, etcd.keys.namespace, os.path.join(tmp, "work"), "--metrics-listen", metrics,
                              "--log-format", "json")
        spec = lenet_spec(os.path.join(tmp, "job.toml"), JOB, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"),
                          TOTAL, env={"MSELASTIC_FAULT": "sigkill:rank=1:generation=1:step=20"},
                          args=["--data", DATA_DIR,
                                "--out", os.path.join(tmp, "out"), "--lr", "0.05", "--step-sleep-s", "0.2"])
        r = elasticctl("submit", spec, endpoint=endpoint)
        assert r.returncode == 0, r.stderr
        yield Run(endpoint, metrics, etcd, tmp)
    finally:
        leftovers = procs.stop_all()
        assert not leftovers, f"processes left behind: {leftovers}"


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_show_the_restart_and_the_recovery_latency(run: Run) -> None:
    m = wait_for("the recovery in the metrics", lambda: (m := scrape(run.metrics))
                 and m.get('mselastic_recovery_seconds_count{job="lenet"}') == 1.0 and m, 180, 0.5)
    assert m['mselastic_restarts_total{job="lenet",reason="rank_failure"}'] == 1.0
    assert 1.0 < m['mselastic_recovery_seconds_sum{job="lenet"}'] < 60.0
    assert m["mselastic_failure_detection_seconds_count"] == 1.0
    assert m["mselastic_failure_detection_seconds_sum"] < 5.0
    assert m["mselastic_leader"] == 1.0 and m['mselastic_generations_total{job="lenet"}'] == 2.0
    assert m['mselastic_world_size{job="lenet"}'] == 2.0 and m['mselastic_generation{job="lenet"}'] == 2.0
    status = run.etcd.status(JOB)
    assert status is not None and status.last_failure is not None
    assert abs(m['mselastic_recovery_seconds_sum{job="lenet"}'] - status.last_failure.recover_s) < 0.01
    wait_for("a step rate", lambda: scrape(run.metrics).get('mselastic_step_rate{job="lenet"}', 0) > 0, 30, 0.5)


def test_restart_is_planned_and_watch_redraws_in_a_terminal(run: Run) -> None:
    # Rank 0's log of generation 2, followed live from its agent until the restart ends that generation.
    logs = [os.path.join(VENV_BIN, "elasticctl"), "--endpoints", run.endpoint, "logs", JOB, "--rank", "0", "-f"]
    follow = subprocess.Popen(logs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert select.select([follow.stdout], [], [], 60)[0], "logs -f printed nothing"  # attached to generation 2
    assert follow.stdout is not None and follow.stdout.readline()
    r = run.ctl("restart", JOB, "-o", "json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"job": JOB, "generation": 3}, r.stdout + r.stderr
    # Generation 3 is planned but its ranks are (most likely) not started yet: -f waits for its log.
    wait_for("generation 3 planned", lambda: (p := run.etcd.plan(JOB)) is not None and p.generation == 3, 60, 0.1)
    follow3 = subprocess.Popen(logs + ["--generation", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = pexpect.spawn(os.path.join(VENV_BIN, "elasticctl"), ["--endpoints", run.endpoint, "watch", JOB,
                                                                 "--interval-s", "0.5"],
                          dimensions=(30, 110), env={**os.environ, "TERM": "xterm-256color"}, timeout=240)
    try:
        child.expect("samples/s")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    screen = child.before.decode(errors="replace") if isinstance(child.before, bytes) else str(child.before)
    assert child.exitstatus == 0, screen[-2000:]  # the job SUCCEEDED
    assert "\x1b[" in screen and screen.count("generation") > 3  # redrawn in place, frame after frame
    assert "SUCCEEDED" in screen and f"{TOTAL}/{TOTAL}" in screen
    plan = run.etcd.plan(JOB)
    assert plan is not None and plan.generation == 3 and plan.planned and plan.restart_count == 1
    try:
        followed, err = follow.communicate(timeout=60)
    finally:
        follow.kill()
    assert follow.returncode == 0 and "checkpointed at step" in followed and "RESULT" not in followed, err
    try:
        followed3, err3 = follow3.communicate(timeout=60)
    finally:
        follow3.kill()
    assert follow3.returncode == 0 and "RESULT" in followed3, err3  # followed from its start to the job's end
    rep = run.etcd.report(JOB, 3, "n0")
    rep2 = run.etcd.report(JOB, 2, "n0")
    assert rep is not None and rep2 is not None and rep.resumed_step == rep2.exit_step > 0  # nothing recomputed


def test_watch_prints_lines_when_not_a_terminal(run: Run) -> None:
    r = run.ctl("watch", JOB)
    assert r.returncode == 0 and "\x1b[" not in r.stdout
    assert re.search(rf"{JOB} SUCCEEDED gen=3 world=2 step={TOTAL}/{TOTAL} \(100%\)", r.stdout), r.stdout


@pytest.mark.parametrize("args", [["status"], ["status", JOB], ["nodes"], ["jobs"], ["describe", "job", JOB],
                                  ["events", JOB], ["events", JOB, "--progress"]])
def test_read_commands_in_every_format(run: Run, args: list[str]) -> None:
    table = run.ctl(*args)
    assert table.returncode == 0 and table.stdout.strip() and not table.stderr.strip(), table.stderr
    as_json = run.ctl(*args, "-o", "json")
    as_yaml = run.ctl(*args, "-o", "yaml")
    assert as_json.returncode == 0 and as_yaml.returncode == 0
    assert json.loads(as_json.stdout) == yaml.safe_load(as_yaml.stdout)


def test_tables_say_what_happened(run: Run) -> None:
    nodes = run.ctl("nodes").stdout
    assert re.search(r"n0\s+127\.0\.0\.1:\d+\s+0/2\s+Ready\s+\*", nodes), nodes  # used/all slots
    jobs = run.ctl("jobs").stdout
    assert re.search(rf"{JOB}\s+SUCCEEDED\s+3\s+2\s+{TOTAL}/{TOTAL}", jobs), jobs
    described = run.ctl("describe", "job", JOB).stdout
    assert "Generations:" in described and "planned: restart requested by the operator" in described
    assert "rank 1 on node n0 failed" in described and "recovered in" in described
    events = run.ctl("events", JOB).stdout
    kinds = re.findall(r"^\S+\s+\S+\s+(\S+)", events, re.M)[1:]
    assert kinds[:2] == ["submitted", "generation"] and "recovered" in kinds and "planned" in kinds, events
    assert re.search(r"generation\s.*\[detected \d\d:\d\d:\d\d\.\d\d on the node\]", events), events
    assert "progress" not in kinds
    data = json.loads(run.ctl("events", JOB, "--progress", "-o", "json").stdout)["events"]
    progress = [e for e in data if e["kind"] == "progress"]
    assert len(progress) >= 10 and all(e["world_size"] == 2 for e in progress)


def test_logs_come_from_the_agent(run: Run) -> None:
    r = run.ctl("logs", JOB, "--rank", "0")
    assert r.returncode == 0 and "RESULT" in r.stdout and f'"final_step": {TOTAL}' in r.stdout
    first = run.ctl("logs", JOB, "--rank", "1", "--generation", "1", "-f")  # ended: -f returns at the end
    assert first.returncode == 0 and first.stdout and "RESULT" not in first.stdout
    tail = run.ctl("logs", JOB, "--rank", "0", "--tail-bytes", "300")
    assert tail.returncode == 0 and 0 < len(tail.stdout.encode()) <= 300
    r = run.ctl("logs", JOB, "--rank", "7")
    assert r.returncode == 1 and "ranks 0..1, not 7" in r.stderr


def test_report_draws_a_png(run: Run) -> None:
    path = os.path.join(run.tmp, "timeline.png")
    r = run.ctl("report", JOB, "-o", path)
    assert r.returncode == 0, r.stderr
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1100, 650) and 20_000 < len(data) < 2_000_000
    # The IDAT stream decompresses: the file is a whole PNG, not a truncated one.
    idat = b"".join(data[i + 8: i + 8 + struct.unpack(">I", data[i: i + 4])[0]]
                    for i in [m.start() - 4 for m in re.finditer(b"IDAT", data)])
    assert len(zlib.decompress(idat)) >= width * height


def test_scale_checks_the_new_range(run: Run) -> None:
    r = run.ctl("scale", JOB, "--min", "3", "--max", "2")
    assert r.returncode == 1 and "nothing to scale" in r.stderr  # the job has ended
    r = run.ctl("scale", JOB)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_cordon_and_uncordon(run: Run) -> None:
    r = run.ctl("cordon", "n0", "--reason", "maintenance", "-o", "yaml")
    assert r.returncode == 0 and yaml.safe_load(r.stdout) == {"node": "n0", "cordoned": True, "draining": False}
    assert re.search(r"n0\s.*Cordoned", run.ctl("nodes").stdout)
    assert run.ctl("uncordon", "n0").returncode == 0
    assert re.search(r"n0\s.*Ready", run.ctl("nodes").stdout)
    r = run.ctl("cordon", "nope")
    assert r.returncode == 1 and "no node named 'nope'" in r.stderr


@pytest.mark.parametrize("args, code, words", [
    (["describe", "job", "nope"], 1, "no job named 'nope'"),
    (["events", "nope"], 1, "no job named 'nope'"),
    (["restart", JOB], 1, "only a RUNNING job can be restarted"),
    (["logs", "nope", "--rank", "0"], 1, "no job named 'nope'"),
    (["frobnicate"], 2, "invalid choice"),
    (["jobs", "-o", "xml"], 2, "invalid choice"),
    (["logs", JOB], 2, "--rank"),
    (["report", JOB, "-o", "timeline.svg"], 2, "PNG"),
    (["--cacert", "/nonexistent.pem", "jobs"], 2, "--cacert"),
    (["--cert", "/etc/hostname", "jobs"], 2, "--cert and --key go together"),
    (["--endpoints", "nocolon", "jobs"], 2, "host:port"),
])
def test_bad_input_is_one_line_with_a_documented_code(run: Run, args: list[str], code: int, words: str) -> None:
    r = run.ctl(*args)
    assert r.returncode == code, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr and "Traceback" not in r.stderr


def test_unreachable_endpoints_exit_3_and_a_live_one_in_the_list_is_used(run: Run) -> None:
    dead = f"127.0.0.1:{free_port()}"
    r = subprocess.run([os.path.join(VENV_BIN, "elasticctl"), "--endpoints", dead, "jobs"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1 and "cannot reach elasticd" in r.stderr
    env = {**os.environ, "ELASTICCTL_ENDPOINTS": f"{dead},{run.endpoint}"}
    r = subprocess.run([os.path.join(VENV_BIN, "elasticctl"), "jobs"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0 and JOB in r.stdout


def test_daemon_logs_are_json_naming_job_generation_node_and_rank(run: Run) -> None:
    with open(os.path.join(run.tmp, "elasticd-n0.log")) as f:
        lines = [json.loads(line) for line in f if line.startswith("{")]
    assert lines and all({"ts", "level", "job", "generation", "node", "rank", "msg"} <= set(r) for r in lines)
    failed = [r for r in lines if "failed" in r["msg"] and r["rank"] == 1]
    assert failed and failed[0]["job"] == JOB and failed[0]["generation"] == 1 and failed[0]["node"] == "n0"
    assert any(r["job"] == JOB and r["generation"] == 3 for r in lines)


def test_delete_frees_the_name_and_a_resubmission_resumes_from_the_checkpoints(run: Run) -> None:
    """Last test on the run: it removes the job's records."""
    r = run.ctl("delete", "nope")
    assert r.returncode == 1 and "no job named 'nope'" in r.stderr
    r = run.ctl("delete", JOB, "-o", "json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"job": JOB, "deleted": True, "last_generation": 3}, r.stderr
    k = run.etcd.keys
    assert not run.etcd.prefix(k.job(JOB)) and not run.etcd.prefix(k.plans(JOB)) and not run.etcd.prefix(k.events(JOB))
    assert run.ctl("describe", "job", JOB).returncode == 1 and JOB not in run.ctl("jobs").stdout
    assert not [s for s in scrape(run.metrics) if f'job="{JOB}"' in s]  # its metrics are gone too
    # The same name again, 10 more steps: generation 4 (agents refuse older ones), resumed at TOTAL.
    spec = lenet_spec(os.path.join(run.tmp, "job2.toml"), JOB, os.path.join(run.tmp, "out"),
                      os.path.join(run.tmp, "ckpt"), TOTAL + 10,
                      args=["--data", DATA_DIR, "--out", os.path.join(run.tmp, "out"), "--step-sleep-s", "0.5"])
    assert run.ctl("submit", spec).returncode == 0
    wait_for("generation 4 training", lambda: (rep := run.etcd.report(JOB, 4, "n0")) and rep.step > TOTAL, 120, 0.2)
    r = run.ctl("delete", JOB)
    assert r.returncode == 1 and "is RUNNING; stop it first" in r.stderr and len(r.stderr.splitlines()) == 1
    wait_for("the job to succeed", lambda: (s := run.etcd.status(JOB)) and s.state is JobState.SUCCEEDED, 120, 0.5)
    rep = run.etcd.report(JOB, 4, "n0")
    assert rep is not None and rep.resumed_step == TOTAL and rep.step == TOTAL + 10
    plan = run.etcd.plan(JOB)
    assert plan is not None and plan.generation == 4 and plan.restart_count == 0


def test_every_command_has_help_with_an_example() -> None:
    from mselastic.ctl.main import COMMANDS

    for command in COMMANDS:
        r = subprocess.run([sys.executable, "-m", "mselastic.ctl.main", command, "--help"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and "Example: elasticctl " in r.stdout, command
    top = subprocess.run([os.path.join(VENV_BIN, "elasticctl"), "--help"], capture_output=True, text=True, timeout=60)
    assert "Exit codes:" in top.stdout and "ELASTICCTL_CACERT" in top.stdout
