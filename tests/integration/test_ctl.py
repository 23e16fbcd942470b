"""elasticctl against a real elasticd: clean one-line errors, documented exit codes, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from mselastic.store.embedded import free_port
from tests.harness import VENV_BIN, Etcd, Processes, elasticctl, elasticd_cmd, lenet_spec, local_socket, wait_for


@pytest.fixture
def endpoint(procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> str:
    port = free_port()
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, port, str(tmp_path), namespace))
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    return "unix:" + local_socket(str(tmp_path))


@pytest.mark.parametrize("override, field", [
    ({"min_nodes": 3}, "min_nodes"),
    ({"hang_timeout_s": -1}, "hang_timeout_s"),
    ({"bogus": 1}, "bogus"),
    ({"keep_checkpoints": "many"}, "keep_checkpoints"),
])
def test_bad_spec_fails_cleanly_and_writes_nothing(endpoint: str, etcd: Etcd, tmp_path: os.PathLike[str],
                                                   override: dict[str, object], field: str) -> None:
    tmp = str(tmp_path)
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "lenet", tmp, tmp, total_steps=10, **override)
    r = elasticctl("submit", spec, endpoint=endpoint)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"field '{field}'" in lines[0] and "Traceback" not in r.stderr
    assert etcd.prefix(etcd.keys.jobs) == {}


def test_server_refuses_bad_spec_sent_directly(endpoint: str, etcd: Etcd) -> None:
    """A client that skips local validation still cannot write a bad spec."""
    import grpc

    from mselastic.v1 import elastic_pb2 as pb
    from mselastic.v1 import elastic_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.ControlStub(ch).Submit(pb.SubmitRequest(spec_json='{"name": "x"}'), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "field 'script'" in (e.value.details() or "")
    assert etcd.prefix(etcd.keys.jobs) == {}


def test_unknown_job_and_unreachable_endpoint(endpoint: str, tmp_path: os.PathLike[str]) -> None:
    r = elasticctl("status", "nope", endpoint=endpoint)
    assert r.returncode == 1 and "no job named 'nope'" in r.stderr
    r = elasticctl("stop", "nope", endpoint=endpoint)
    assert r.returncode == 1 and "no job named 'nope'" in r.stderr
    r = elasticctl("status", endpoint=f"127.0.0.1:{free_port()}")
    assert r.returncode == 3 and "cannot reach elasticd" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = elasticctl("submit", os.path.join(str(tmp_path), "missing.toml"), endpoint=endpoint)
    assert r.returncode == 2 and "cannot read spec file" in r.stderr


def test_duplicate_submit_and_stop(endpoint: str, etcd: Etcd, tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    # A job more nodes than there are are needed for (one node here): it stays PENDING, so it can be stopped.
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "big", tmp, tmp, total_steps=10, min_nodes=2, max_nodes=2)
    r = elasticctl("submit", spec, endpoint=endpoint)
    # Accepted, with a warning that names why it cannot start (exit 0: it waits for nodes).
    assert r.returncode == 0 and "warning: only 1 registered node(s) can run it" in r.stderr, r.stderr
    r = elasticctl("scale", "big", "--min", "4", "--max", "4", endpoint=endpoint)
    assert r.returncode == 0 and "warning: only 1 registered node(s)" in r.stderr and "min_nodes=4" in r.stderr
    # One that no node is large enough for (4 workers, 2 slots) is refused, naming the sizes.
    wide = lenet_spec(os.path.join(tmp, "wide.toml"), "wide", tmp, os.path.join(tmp, "w"), total_steps=10, workers=4)
    r = elasticctl("submit", wide, endpoint=endpoint)
    assert r.returncode == 1 and "workers_per_node=4 is more than any registered node's slots (n0: 2)" in r.stderr, \
        r.stderr
    assert etcd.status("wide") is None
    r = elasticctl("submit", spec, endpoint=endpoint)
    assert r.returncode == 1 and "already exists" in r.stderr
    wait_for("waiting message", lambda: (s := etcd.status("big")) and "waiting for nodes" in s.message, 10)
    r = elasticctl("stop", "big", endpoint=endpoint)
    assert r.returncode == 0 and "STOPPED" in r.stdout
    status = etcd.status("big")
    assert status is not None and status.state.value == "STOPPED"


def test_a_resubmission_already_past_total_steps_is_refused(endpoint: str, etcd: Etcd,
                                                             tmp_path: os.PathLike[str]) -> None:
    """After a 3000-step run, the same checkpoint_dir with total_steps = 300 would 'succeed' at once:
    refused, saying how to train further and how to start over; --force submits it with a warning."""
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "ckpt")
    os.makedirs(ckpt)
    with open(os.path.join(ckpt, "ckpt-00001487.json"), "w") as f:
        json.dump({"step": 1487, "file": "ckpt-00001487.ckpt"}, f)
    with open(os.path.join(ckpt, "latest.json"), "w") as f:
        json.dump({"manifest": "ckpt-00001487.json"}, f)
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "again", tmp, ckpt, total_steps=300, min_nodes=2, max_nodes=2)
    r = elasticctl("submit", spec, endpoint=endpoint)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "checkpoint of step 1487, at or past total_steps=300: this job is done there" in r.stderr, r.stderr
    assert "raise total_steps" in r.stderr and "to start over, give another checkpoint_dir" in r.stderr, r.stderr
    assert etcd.status("again") is None  # nothing written
    more = lenet_spec(os.path.join(tmp, "more.toml"), "again", tmp, ckpt, total_steps=3000, min_nodes=2, max_nodes=2)
    assert elasticctl("submit", more, endpoint=endpoint).returncode == 0  # more steps: a resume
    assert elasticctl("stop", "again", endpoint=endpoint).returncode == 0
    assert elasticctl("delete", "again", endpoint=endpoint).returncode == 0
    r = elasticctl("submit", "--force", spec, endpoint=endpoint)
    assert r.returncode == 0 and "it resumes at step 1487 of 300: it ends at once, without training" in r.stderr, \
        r.stderr


def test_json_and_yaml_have_numbers_and_every_field(endpoint: str, etcd: Etcd, tmp_path: os.PathLike[str]) -> None:
    import yaml

    tmp = str(tmp_path)
    # (min_nodes=2 on one node: it stays PENDING)
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "big", tmp, tmp, total_steps=10, min_nodes=2, max_nodes=2)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    for fmt, parse in (("json", json.loads), ("yaml", yaml.safe_load)):
        r = elasticctl("status", "-o", fmt, endpoint=endpoint)
        assert r.returncode == 0, r.stderr
        data = parse(r.stdout)
        job, node = data["jobs"][0], data["nodes"][0]
        assert job["generation"] == 0 and job["restart_count"] == 0 and job["total_steps"] == 10, job
        assert job["step"] == -1 and job["members"] == [] and job["note"] == "", job
        assert node["cordoned"] is False and node["draining"] is False and node["used_slots"] == 0, node
        assert node["slots"] == 2 and node["running_jobs"] == [], node


def test_exit_codes_tell_a_wrong_endpoint_from_etcd_down(procs: Processes, namespace: str,
                                                         tmp_path: os.PathLike[str]) -> None:
    from mselastic.store.embedded import EmbeddedEtcd

    tmp = str(tmp_path)
    server = EmbeddedEtcd(os.path.join(tmp, "etcd")).start()
    try:
        port = free_port()
        procs.start("elasticd-n0", elasticd_cmd("n0", server.endpoint, port, os.path.join(tmp, "w"), namespace))
        wait_for("n0 leading", lambda: Etcd(server.endpoint, namespace).leader() == "n0", 30)
        # etcd's own port: a gRPC server, but not an elasticd.
        r = elasticctl("jobs", endpoint=server.endpoint)
        assert r.returncode == 4 and "is not an elasticd" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
        server.stop()
        started = time.monotonic()
        r = elasticctl("jobs", endpoint=f"127.0.0.1:{port}")
        assert r.returncode == 5 and "answered but cannot reach etcd" in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1 and time.monotonic() - started < 7, r.stderr
    finally:
        server.stop()


def test_a_second_job_with_the_same_checkpoint_dir_is_refused(endpoint: str, etcd: Etcd,
                                                               tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "ckpt")
    # (min_nodes=2 on one node: it stays PENDING)
    first = lenet_spec(os.path.join(tmp, "a.toml"), "first", tmp, ckpt, total_steps=10, min_nodes=2, max_nodes=2)
    assert elasticctl("submit", first, endpoint=endpoint).returncode == 0
    copy = lenet_spec(os.path.join(tmp, "b.toml"), "copy", tmp, ckpt + "/", total_steps=10, min_nodes=2, max_nodes=2)
    r = elasticctl("submit", copy, endpoint=endpoint)
    assert r.returncode == 1 and f"checkpoint_dir {ckpt}/ belongs to job first" in r.stderr, r.stderr
    assert etcd.status("copy") is None
    assert elasticctl("stop", "first", endpoint=endpoint).returncode == 0
    assert elasticctl("delete", "first", endpoint=endpoint).returncode == 0
    assert elasticctl("submit", copy, endpoint=endpoint).returncode == 0  # the directory is free again
    # Two submits at once with one new directory: the claim is part of the Submit transaction, so
    # exactly one of them gets it, however the two interleave.
    for i in range(3):
        specs = [lenet_spec(os.path.join(tmp, f"race{i}{j}.toml"), f"race{i}{j}", tmp, os.path.join(tmp, f"dir{i}"),
                            total_steps=10, min_nodes=2, max_nodes=2) for j in range(2)]
        cmds = [subprocess.Popen([os.path.join(VENV_BIN, "elasticctl"), "--endpoint", endpoint, "submit", spec],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for spec in specs]
        codes = [c.wait(timeout=60) for c in cmds]
        assert sorted(codes) == [0, 1], [c.stderr.read() if c.stderr else "" for c in cmds]


def test_a_week_of_events_is_pruned_and_reads_stay_quick(procs: Processes, etcd: Etcd, namespace: str,
                                                         tmp_path: os.PathLike[str]) -> None:
    """A week of progress events (one every 10 s: 60,480) left by earlier leaders: the next leader
    prunes them to keep_events, and events/describe answer at once."""
    import asyncio

    from mselastic.core.kinds import EventKind
    from mselastic.core.model import Event
    from mselastic.store.etcd import Store

    tmp, port = str(tmp_path), free_port()
    cmd = elasticd_cmd("n0", etcd.endpoint, port, os.path.join(tmp, "w"), namespace)
    d = procs.start("elasticd-n0", cmd)
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    endpoint = "unix:" + local_socket(os.path.join(tmp, "w"))
    # (min_nodes=2 on one node: it stays PENDING)
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "old", tmp, tmp, total_steps=10, min_nodes=2, max_nodes=2)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    d.terminate()
    d.wait(timeout=30)

    async def flood() -> None:
        store = Store(etcd.endpoint, etcd.keys)
        tx, week, now = store.tx, 60_480, time.time_ns()  # within keep_events_s: pruned by count
        try:
            # ... and 100 from 40 days ago, past keep_events_s (30 days): pruned by age.
            await store.txn([], [tx.put(etcd.keys.event("old", now - (40 * 86400 + i) * 10**9).encode(), Event(
                at=now / 1e9 - 40 * 86400 - i, kind=EventKind.PROGRESS, generation=1, message="ancient",
                step=i).to_json().encode()) for i in range(100)])
            for start in range(0, week, 120):
                await store.txn([], [tx.put(etcd.keys.event("old", now - (week - i) * 10**10).encode(), Event(
                    at=(now - (week - i) * 10**10) / 1e9, kind=EventKind.PROGRESS, generation=1, message=f"step {i}",
                    step=i).to_json().encode()) for i in range(start, min(week, start + 120))])
        finally:
            await store.close()
    def count() -> int:
        async def fn(s: Store) -> int:
            return len(await s.keys_under(etcd.keys.events("old")))
        return etcd._run(fn)  # type: ignore[no-any-return]
    asyncio.run(flood())
    assert count() > 60_000
    procs.start("elasticd-n0-again", cmd)
    wait_for("events pruned to keep_events", lambda: count() <= 2000, 60, 1)
    for args in (["events", "old", "--progress"], ["describe", "job", "old"]):
        started = time.monotonic()
        r = elasticctl(*args, endpoint=endpoint)
        assert r.returncode == 0 and time.monotonic() - started < 10, (args, r.stderr)
    shown = elasticctl("events", "old", "--progress", endpoint=endpoint).stdout
    assert "step 60479" in shown and "ancient" not in shown  # the newest kept, the too old gone


@pytest.mark.parametrize("args, words", [
    (["scale", "lenet", "--max", "99999999999"], "argument --max: 99999999999 is not in 0..100000"),
    (["logs", "lenet", "--rank", "99999999999"], "argument --rank: 99999999999 is not in 0..2147483647"),
    (["stop", "lenet", "--grace-period-s", "nan"], "--grace-period-s must be a number of seconds in 0..2592000"),
])
def test_numbers_beyond_the_wire_are_refused_with_one_line(args: list[str], words: str) -> None:
    r = elasticctl(*args, endpoint="127.0.0.1:1")  # refused before anything is sent
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and words in r.stderr, r.stderr


def test_logs_are_never_read_through_a_symlink_or_a_fifo(endpoint: str, tmp_path: os.PathLike[str]) -> None:
    """A worker (its own user) owns its log folder: a symlink it plants there must not make root
    read another file, and a FIFO must not block elasticd's event loop."""
    import grpc

    from mselastic.v1 import elastic_pb2 as pb
    from mselastic.v1 import elastic_pb2_grpc as pb_grpc

    logs = os.path.join(str(tmp_path), "logs", "fake", "g000001")
    os.makedirs(logs)
    os.symlink("/etc/hostname", os.path.join(logs, "worker_0.log"))
    os.mkfifo(os.path.join(logs, "worker_1.log"))
    with grpc.insecure_channel(endpoint) as ch:
        for rank in (0, 1):
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.AgentStub(ch).Logs(pb.LogsRequest(job="fake", rank=rank, generation=1), timeout=5))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        assert pb_grpc.AgentStub(ch).Status(pb.AgentStatusRequest(), timeout=5).node_id == "n0"  # still serving


def test_a_node_removed_for_good_leaves_no_record_and_one_still_running_cannot_be(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """The operations guide's removal: drain n1 (cordoned, one of its devices set aside), then
    `remove-node` is refused while its elasticd runs; once stopped, it deletes the node's cordon
    and device records, and nothing else (n0's cordon stays); a second removal finds nothing."""
    import signal

    tmp = str(tmp_path)
    nodes = {}
    for n in ("n0", "n1"):
        work = os.path.join(tmp, n)
        nodes[n] = procs.start(f"elasticd-{n}", elasticd_cmd(n, etcd.endpoint, free_port(), work, namespace)
                               + ["--devices", "0-1", "--device-kind", "gpu"])
        if n == "n0":
            wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    wait_for("both registered", lambda: len(etcd.prefix(etcd.keys.nodes)) == 2, 30)
    endpoint = "unix:" + local_socket(os.path.join(tmp, "n0"))
    for args in (["cordon", "n1", "--device", "1"], ["drain", "n1"], ["cordon", "n0", "--reason", "kept"]):
        r = elasticctl(*args, endpoint=endpoint)
        assert r.returncode == 0, r.stderr
    cordons = etcd.keys.cordons
    # A node gone earlier whose id starts with n1's: its records are not n1's.
    from mselastic.core.model import CordonRecord, DeviceCordon

    etcd.put(cordons + "n10", CordonRecord("n10", False, time.time(), "gone").to_json())
    etcd.put(etcd.keys.device_cordon("n10", 1), DeviceCordon("n10", 1, "gone", time.time()).to_json())
    assert sorted(etcd.prefix(cordons)) == [cordons + k for k in ("n0", "n1", "n1/devices/1", "n10", "n10/devices/1")]
    r = elasticctl("remove-node", "n1", endpoint=endpoint)
    assert r.returncode == 1 and "node n1 is registered: stop its elasticd for good first" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and len(etcd.prefix(cordons)) == 5
    nodes["n1"].send_signal(signal.SIGINT)  # (systemctl disable --now elasticd, on n1)
    nodes["n1"].wait(timeout=60)
    assert nodes["n1"].returncode == 0
    assert list(etcd.prefix(etcd.keys.nodes)) == [etcd.keys.node("n0")]  # its registration went with it
    r = elasticctl("remove-node", "n1", endpoint=endpoint)
    assert r.returncode == 0 and "node n1 removed (2 record(s) deleted)" in r.stdout, r.stderr
    assert sorted(etcd.prefix(cordons)) == [cordons + "n0", cordons + "n10", cordons + "n10/devices/1"]
    again = elasticctl("remove-node", "n1", endpoint=endpoint)
    assert again.returncode == 1 and "no node named 'n1'" in again.stderr, again.stderr
