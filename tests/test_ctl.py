"""elasticctl against a real elasticd: clean one-line errors, documented exit codes, nothing written."""

from __future__ import annotations

import os

import pytest

from mselastic.store.embedded import free_port
from tests.harness import Etcd, Processes, elasticctl, elasticd_cmd, lenet_spec, wait_for


@pytest.fixture
def endpoint(procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> str:
    port = free_port()
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, port, str(tmp_path), namespace))
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    return f"127.0.0.1:{port}"


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
    # A job that cannot start (needs 4 slots per node): it stays PENDING, so it can be stopped.
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "big", tmp, tmp, total_steps=10, workers=4)
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    r = elasticctl("submit", spec, endpoint=endpoint)
    assert r.returncode == 1 and "already exists" in r.stderr
    wait_for("waiting message", lambda: (s := etcd.status("big")) and "waiting for nodes" in s.message, 10)
    r = elasticctl("stop", "big", endpoint=endpoint)
    assert r.returncode == 0 and "STOPPED" in r.stdout
    status = etcd.status("big")
    assert status is not None and status.state.value == "STOPPED"
