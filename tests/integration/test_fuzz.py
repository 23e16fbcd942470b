"""Hostile and absurd input never hangs, crashes or acts: property-based tests (hypothesis, a fixed
seed and example budget) over job specs, the etcd records the daemon decodes, and every RPC of
both gRPC services against a live elasticd."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from mselastic.core.model import CordonRecord, GenerationReport, JobStatus, MalformedRecord, NodeRecord, Plan
from mselastic.core.spec import JobSpec, SpecError
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc
from tests.harness import Etcd, Processes, start_node

SEED = 20261201
FIELDS = [f.name for f in JobSpec.__dataclass_fields__.values()]

numbers = st.one_of(st.integers(), st.integers(min_value=-10, max_value=10), st.floats(allow_nan=True),
                    st.just(10**9), st.just(2**63), st.just(-(2**63) - 1))
scalars = st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=20), st.just("/abs/path"))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)


def base_spec(tmp: str = "/nonexistent-fuzz") -> dict[str, Any]:
    """A valid spec whose script does not exist: if a fuzzed variant is accepted and placed, its
    launch fails in preflight and nothing runs (and nothing is created outside ``tmp``)."""
    return dict(name="fz", script=f"{tmp}/missing/train.py", checkpoint_dir=f"{tmp}/ckpt", workers_per_node=1,
                global_batch_size=32)


specs = st.builds(lambda changes: {**base_spec(), **changes},
                  st.dictionaries(st.sampled_from([f for f in FIELDS if f not in ("script", "checkpoint_dir")]),
                                  values, max_size=5))


@seed(SEED)
@settings(max_examples=400, deadline=1000, derandomize=False)
@given(st.one_of(specs, st.dictionaries(st.text(max_size=12), values, max_size=6), values))
def test_any_spec_is_accepted_or_refused_with_one_line_quickly(data: Any) -> None:
    started = time.monotonic()
    try:
        spec = JobSpec.from_dict(data)
    except SpecError as e:
        assert "\n" not in str(e) and str(e).startswith(("field ", "spec must be")), str(e)
    else:
        assert JobSpec.from_json(spec.to_json()) == spec
        spec.valid_world_sizes()
        spec.node_count(100_000)
    assert time.monotonic() - started < 0.5


def test_huge_ranges_are_refused_at_once() -> None:
    for field, value in (("max_nodes", 10**9), ("workers_per_node", 10**6), ("total_steps", 2**63),
                         ("hang_timeout_s", float("inf")), ("hang_timeout_s", float("nan"))):
        started = time.monotonic()
        with pytest.raises(SpecError, match=f"field '{field}'"):
            JobSpec.from_dict({**base_spec(), field: value})
        assert time.monotonic() - started < 0.5
    # The largest allowed range is still computed at once (only divisors are tried).
    spec = JobSpec.from_dict({**base_spec(), "max_nodes": 100_000, "workers_per_node": 1024,
                              "global_batch_size": 2**30})
    started = time.monotonic()
    assert spec.valid_world_sizes() and spec.node_count(100_000) > 0
    assert time.monotonic() - started < 1.0


RECORDS = [NodeRecord, Plan, GenerationReport, JobStatus, CordonRecord]
_MEMBER = {"node_id": "n0", "node_rank": 0, "local_workers": 1, "agent_address": "a:1", "host": "h"}
#: A valid record of each kind: the fuzzing below changes one field at a time, so that decoding
#: gets past the required fields and into the conversions (members, last_failure, enums).
VALID: dict[type, dict[str, Any]] = {
    NodeRecord: {"node_id": "n0", "agent_address": "a:1", "host": "h", "slots": 2, "version": "t"},
    Plan: {"job": "j", "generation": 1, "members": [_MEMBER], "world_size": 1, "master_addr": "h",
           "master_port": 20001, "restart_count": 0, "reason": "r", "planned": False, "kind": "initial"},
    GenerationReport: {"job": "j", "generation": 1, "node_id": "n0", "state": "RUNNING", "cause": "", "step": 3},
    JobStatus: {"state": "RUNNING", "generation": 1, "node_failures": {"n0": 1}, "quarantined_until": {},
                "last_failure": {"generation": 1, "node_id": "n0", "rank": 0, "reason": "x", "detected_at": 1.0,
                                 "cause": "RANK_EXITED"}, "scale_up_nodes": ["n1"]},
    CordonRecord: {"node_id": "n0", "drain": True, "at": 1.0},
}


@seed(SEED)
@settings(max_examples=300, deadline=1000)
@given(st.sampled_from(RECORDS), st.one_of(values, st.dictionaries(
    st.sampled_from(sorted({f for r in RECORDS for f in r.__dataclass_fields__})), values, max_size=8)))
def test_any_etcd_value_decodes_or_is_malformed(cls: type, data: Any) -> None:
    try:
        cls.from_json(json.dumps(data))  # type: ignore[attr-defined]
    except MalformedRecord:
        pass


@seed(SEED)
@settings(max_examples=400, deadline=1000)
@given(st.sampled_from(RECORDS), st.data())
def test_a_valid_record_with_one_field_changed_decodes_to_the_right_types_or_is_malformed(
        cls: type, data: st.DataObject) -> None:
    valid = VALID[cls]
    assert cls.from_json(json.dumps(valid)) is not None  # type: ignore[attr-defined]
    field = data.draw(st.sampled_from(sorted(valid)))
    nested = data.draw(st.booleans())
    record = json.loads(json.dumps(valid))
    if nested and field == "members":
        record["members"][0][data.draw(st.sampled_from(sorted(_MEMBER)))] = data.draw(values)
    elif nested and field == "last_failure":
        record["last_failure"][data.draw(st.sampled_from(sorted(record["last_failure"])))] = data.draw(values)
    else:
        record[field] = data.draw(values)
    try:
        decoded = cls.from_json(json.dumps(record))  # type: ignore[attr-defined]
    except MalformedRecord:
        return
    # Whatever was accepted has the declared types: nothing odd reaches the planner.
    for f in dataclasses.fields(decoded):
        value, kind = getattr(decoded, f.name), str(f.type)
        if kind == "int":
            assert isinstance(value, int) and not isinstance(value, bool), (f.name, value)
        elif kind == "float":
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (f.name, value)
        elif kind == "str":
            assert isinstance(value, str), (f.name, value)
        elif kind == "bool":
            assert isinstance(value, bool), (f.name, value)
        elif kind == "tuple[str, ...]":
            assert isinstance(value, tuple) and all(isinstance(v, str) for v in value), (f.name, value)


# -- both gRPC services, live ------------------------------------------------------------------

def message_strategy(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Field values for any request message: extreme numbers, odd strings, nested messages."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 2:
                continue
            one: st.SearchStrategy[Any] = message_strategy(f.message_type, depth + 1)
        elif f.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_ENUM):
            one = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-3, 3))
        elif f.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64):
            one = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-3, 3))
        elif f.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64):
            one = st.integers(0, 2**32 - 1)
        elif f.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            one = st.floats(allow_nan=True, width=32 if f.type == FieldDescriptor.TYPE_FLOAT else 64)
        elif f.type == FieldDescriptor.TYPE_BOOL:
            one = st.booleans()
        elif f.name == "spec_json":
            one = st.one_of(st.text(max_size=50), specs.map(json.dumps))
        else:
            one = st.one_of(st.text(max_size=40), st.sampled_from(["", "n0", "fz", "lenet", "../x", "a" * 300]))
        if f.is_repeated:
            one = st.lists(one, max_size=3)
        fields[f.name] = one
    return st.fixed_dictionaries({}, optional=fields)


def build(msg: Message, values: dict[str, Any]) -> Message:
    for name, value in values.items():
        f, target = msg.DESCRIPTOR.fields_by_name[name], getattr(msg, name)
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            for v in value if f.is_repeated else ():
                build(target.add(), v)
            if not f.is_repeated:
                build(target, value)
        elif f.is_repeated:
            target.extend(value)
        else:
            setattr(msg, name, value)
    return msg


#: The codes a refusal may carry; UNKNOWN or INTERNAL would be an unhandled exception in the server.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED, grpc.StatusCode.OUT_OF_RANGE}


RPCS = [(service, m) for service in ("Control", "Agent") for m in pb.DESCRIPTOR.services_by_name[service].methods]


def test_every_rpc_refuses_hostile_input_with_a_code_and_never_dies(procs: Processes, etcd: Etcd, namespace: str,
                                                                   tmp_path: os.PathLike[str]) -> None:
    endpoint = start_node(procs, etcd, namespace, os.path.join(str(tmp_path), "work"))
    outcomes: dict[str, dict[str, int]] = {}
    with grpc.insecure_channel(endpoint) as channel:
        for service, desc in RPCS:
            fuzz_rpc(getattr(getattr(pb_grpc, f"{service}Stub")(channel), desc.name), desc,
                     outcomes.setdefault(f"{service}.{desc.name}", {}))
        # Requests are small: one over the server's 1 MiB limit is refused before it is parsed.
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.ControlStub(channel).Submit(pb.SubmitRequest(spec_json="x" * (2 << 20)), timeout=5)
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    print("outcomes:", json.dumps(outcomes, sort_keys=True))
    # The budget was really spent (a request without fields has one example).
    assert all(sum(o.values()) >= 20 for rpc, o in outcomes.items() if rpc != "Agent.Status"), outcomes
    assert procs.started[0].poll() is None, "elasticd died"


def fuzz_rpc(call: Any, desc: Any, outcomes: dict[str, int]) -> None:
    req_cls = getattr(pb, desc.input_type.name)

    @seed(SEED)
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(message_strategy(req_cls.DESCRIPTOR))
    def one(values: dict[str, Any]) -> None:
        try:
            msg = build(req_cls(), values)
        except (ValueError, TypeError):  # the client library refuses it (e.g. a string with a lone surrogate)
            return
        started = time.monotonic()
        try:
            res = call(msg, timeout=5)
            if desc.server_streaming:
                for _ in zip(range(3), res):
                    pass
            outcomes["OK"] = outcomes.get("OK", 0) + 1
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            outcomes[code.name] = outcomes.get(code.name, 0) + 1
            assert code in REFUSALS or (code is grpc.StatusCode.DEADLINE_EXCEEDED and desc.server_streaming), \
                f"{desc.name}({values!r:.300}) -> {code}: {e.details()}"  # type: ignore[attr-defined]
            assert "\n" not in (e.details() or ""), e.details()  # type: ignore[attr-defined]
        if not desc.server_streaming:
            assert time.monotonic() - started < 2.5, f"{desc.name} took {time.monotonic() - started:.1f}s"

    one()
