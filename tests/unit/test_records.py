"""Records, keys, lifecycles and the heartbeat format: pure logic."""

from __future__ import annotations

import pytest

from mselastic.core.contract import Beat
from mselastic.core.model import GenerationReport, JobStatus, MalformedRecord, NodeRecord, Plan
from mselastic.core.states import GenerationState, IllegalTransition, JobState, check_generation_transition, \
    check_job_transition
from mselastic.store.keys import BadName, Keys


def test_keys_layout_and_parsing() -> None:
    k = Keys("/ns")
    assert k.node("n0") == "/ns/nodes/n0"
    assert k.report("job", 3, "n0") == "/ns/reports/job/000000000003/n0"
    assert k.parse_report_key(k.report("job", 3, "n0")) == ("job", 3, "n0")
    assert k.parse_report_key(k.reports("job", 3)) is None and k.parse_report_key(k.plan("job")) is None
    assert k.parse_job_key(k.plan("job")) == ("job", "plan")
    assert k.parse_job_key(k.node("n0")) is None
    # The range of generations 2..3 holds their reports and nothing of 1, 4 or 30 (zero-padded).
    start, end = k.reports("job", 2), k.range_end(k.reports("job", 3))
    inside = [g for g in (1, 2, 3, 4, 30) if start <= k.report("job", g, "n0") < end]
    assert inside == [2, 3] and not start <= k.report("job2", 2, "n0") < end


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "-x", "x" * 64, "a b"])
def test_ids_cannot_escape_their_keys(bad: str) -> None:
    with pytest.raises(BadName):
        Keys().node(bad)


@pytest.mark.parametrize("ns", ["mselastic", "/x/", ""])
def test_bad_namespace(ns: str) -> None:
    with pytest.raises(BadName):
        Keys(ns)


@pytest.mark.parametrize("raw, cls", [
    (b"not json", Plan), (b"[]", Plan), (b'{"job": "x"}', Plan),
    (b'{"state": "DANCING"}', JobStatus), (b'{"node_id": "n"}', NodeRecord),
    (b'{"job":"j","generation":1,"node_id":"n","state":"NOPE"}', GenerationReport),
])
def test_malformed_records_are_refused(raw: bytes, cls: type) -> None:
    with pytest.raises(MalformedRecord):
        cls.from_json(raw)  # type: ignore[attr-defined]


def test_status_round_trip() -> None:
    s = JobStatus(JobState.RUNNING, 2, 1, "m")
    assert JobStatus.from_json(s.to_json()) == s


def test_lifecycles_reject_illegal_transitions() -> None:
    check_job_transition(JobState.RUNNING, JobState.RESTARTING)
    with pytest.raises(IllegalTransition):
        check_job_transition(JobState.SUCCEEDED, JobState.RUNNING)
    with pytest.raises(IllegalTransition):
        check_job_transition(JobState.PENDING, JobState.SUCCEEDED)
    check_generation_transition(GenerationState.STARTING, GenerationState.FAILED)
    with pytest.raises(IllegalTransition):
        check_generation_transition(GenerationState.FAILED, GenerationState.RUNNING)


def test_heartbeat_round_trip_and_garbage() -> None:
    b = Beat("step", rank=1, pid=2, generation=3, step=4, loss=0.5)
    assert Beat.decode(b.encode()) == b
    for junk in (b"", b"{}", b'{"kind": "nap"}', b"\xff"):
        with pytest.raises(ValueError):
            Beat.decode(junk)


def test_ranks_are_contiguous_per_member() -> None:
    from mselastic.core.model import Member

    plan = Plan(job="j", generation=1, members=(Member("a", 0, 2, "a:1", "a"), Member("b", 1, 3, "b:1", "b")),
                world_size=5, master_addr="a", master_port=20001, restart_count=0, reason="t")
    assert [plan.first_rank(n) for n in ("a", "b")] == [0, 2]
    owners = [m.node_id if (m := plan.member_of_rank(r)) else None for r in range(-1, 6)]
    assert owners == [None, "a", "a", "b", "b", "b", None]
    assert Plan.from_json(plan.to_json()) == plan


def test_every_record_says_its_schema_and_a_newer_one_is_refused_in_one_line() -> None:
    """Records carry the schema they were written in (#45, #49: mixed versions during an upgrade):
    one written before schemas, or in this one, is read; a newer one is refused, saying to
    upgrade; a field an older release does not know is ignored (additions keep the schema)."""
    import json

    from mselastic.core import model
    rec = NodeRecord(node_id="n0", agent_address="10.0.0.1:7070", host="10.0.0.1", slots=2, version="1.0",
                     lease_ttl_s=5)
    raw = json.loads(rec.to_json())
    assert raw["schema"] == model.SCHEMA == 1
    assert NodeRecord.from_json(rec.to_json()) == rec
    del raw["schema"]
    assert NodeRecord.from_json(json.dumps(raw)) == rec  # (written before schemas)
    assert NodeRecord.from_json(json.dumps({**raw, "added_later": [1, 2]})) == rec
    with pytest.raises(MalformedRecord) as e:
        NodeRecord.from_json(json.dumps({**raw, "schema": model.SCHEMA + 1}))
    assert str(e.value) == ("NodeRecord: written in record schema 2 by a newer mselastic; this one reads up to "
                            "schema 1: upgrade mselastic on this node")
    for bad in ("1", 0, True, None):
        with pytest.raises(MalformedRecord, match="field 'schema' must be a positive int"):
            NodeRecord.from_json(json.dumps({**raw, "schema": bad}))
