"""Job spec validation: every bad field is refused with one line naming it."""

from __future__ import annotations

import json

import os

import pytest

from mselastic.core.spec import JobSpec, SpecError, load_toml

GOOD = dict(name="lenet", script="/x/train.py", checkpoint_dir="/x/ckpt", workers_per_node=2,
            min_nodes=1, max_nodes=2, total_steps=100, global_batch_size=32)


def test_good_spec_round_trips() -> None:
    spec = JobSpec.from_dict(GOOD)
    assert JobSpec.from_json(spec.to_json()) == spec
    assert spec.world_size_range == (2, 4)


@pytest.mark.parametrize("change, field", [
    ({"name": "Bad_Name"}, "name"),
    ({"name": ""}, "name"),
    ({"script": "train.py"}, "script"),
    ({"checkpoint_dir": "rel/ckpt"}, "checkpoint_dir"),
    ({"workers_per_node": 0}, "workers_per_node"),
    ({"min_nodes": 3, "max_nodes": 2}, "min_nodes"),
    ({"max_nodes": -1}, "max_nodes"),
    ({"total_steps": 0}, "total_steps"),
    ({"total_steps": "10"}, "total_steps"),
    ({"total_steps": True}, "total_steps"),
    ({"hang_timeout_s": -1}, "hang_timeout_s"),
    ({"stop_grace_period_s": -1.0}, "stop_grace_period_s"),
    ({"min_nodes_timeout_s": 0}, "min_nodes_timeout_s"),
    ({"max_restarts": -1}, "max_restarts"),
    ({"global_batch_size": 7, "workers_per_node": 2, "min_nodes": 1, "max_nodes": 1}, "global_batch_size"),
    ({"global_batch_size": 30, "workers_per_node": 4, "min_nodes": 2, "max_nodes": 3}, "global_batch_size"),
    ({"global_batch_size": 32, "micro_batch_sizes": [3, 5]}, "global_batch_size"),
    ({"global_batch_size": 0}, "global_batch_size"),
    ({"micro_batch_sizes": [4, 0]}, "micro_batch_sizes"),
    ({"micro_batch_sizes": 4}, "micro_batch_sizes"),
    ({"scale_up_settle_s": 0}, "scale_up_settle_s"),
    ({"stop_check_interval_steps": 0}, "stop_check_interval_steps"),
    ({"min_nodes": 0}, "min_nodes"),
    ({"args": "--lr 0.1"}, "args"),
    ({"env": {"MSELASTIC_JOB": "x"}}, "env"),
    ({"env": {"A": 1}}, "env"),
    ({"nodes": 3}, "nodes"),
])
def test_bad_field_is_named(change: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict({**GOOD, **change})
    assert str(e.value).startswith(f"field '{field}':")
    assert "\n" not in str(e.value)


def test_missing_required_field() -> None:
    data = dict(GOOD)
    del data["checkpoint_dir"]
    with pytest.raises(SpecError, match="field 'checkpoint_dir': required"):
        JobSpec.from_dict(data)


def test_toml_relative_paths_resolve_against_the_file(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(str(tmp_path), "job.toml")
    with open(path, "w") as f:
        f.write('name = "j"\nscript = "train.py"\ncheckpoint_dir = "ckpt"\n')
    spec = load_toml(path)
    assert spec.script == os.path.join(str(tmp_path), "train.py")
    assert spec.checkpoint_dir == os.path.join(str(tmp_path), "ckpt")


def test_toml_syntax_error_is_one_line(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(str(tmp_path), "job.toml")
    with open(path, "w") as f:
        f.write('name = "j\n')
    with pytest.raises(SpecError, match="not valid TOML"):
        load_toml(path)


def test_valid_world_sizes_and_layouts() -> None:
    spec = JobSpec.from_dict({**GOOD, "workers_per_node": 2, "min_nodes": 1, "max_nodes": 4, "global_batch_size": 48,
                              "micro_batch_sizes": [4, 8]})
    assert spec.valid_world_sizes() == [2, 4, 6]  # 8 would need 6 per rank: neither 4 nor 8 divides it
    layout = spec.layout(4)
    assert layout is not None and (layout.micro_batch, layout.accumulation_steps) == (4, 3)
    layout = spec.layout(6)
    assert layout is not None and (layout.micro_batch, layout.accumulation_steps) == (8, 1)
    assert spec.node_count(4) == 3 and spec.node_count(0) == 0


def test_a_typo_is_answered_with_the_field_it_was_meant_to_be() -> None:
    good = json.loads(JobSpec(name="j", script="/s.py", checkpoint_dir="/c").to_json())
    with pytest.raises(SpecError, match="field 'workers_per_nod': unknown field; did you mean 'workers_per_node'"):
        JobSpec.from_json(json.dumps({**good, "workers_per_nod": 2}))
    with pytest.raises(SpecError) as e:
        JobSpec.from_json(json.dumps({**good, "zzz": 2}))
    assert "did you mean" not in str(e.value) and "known fields are" in str(e.value)


def test_submit_names_the_path_this_node_cannot_see(tmp_path: os.PathLike[str]) -> None:
    from mselastic.daemon.control import unseen_paths

    tmp = str(tmp_path)
    script = os.path.join(tmp, "train.py")
    open(script, "w").close()
    open(os.path.join(tmp, "file"), "w").close()

    def unseen(script: str, ckpt: str) -> str:
        return unseen_paths(JobSpec(name="j", script=script, checkpoint_dir=ckpt))

    assert unseen(script, os.path.join(tmp, "new", "deeper", "ckpt")) == ""  # made at launch
    assert unseen(os.path.join(tmp, "nope.py"), tmp) == f"script {tmp}/nope.py does not exist"
    assert unseen(tmp, tmp) == f"script {tmp} is a folder"
    assert unseen(script, os.path.join(tmp, "file", "ckpt")) == \
        f"checkpoint_dir {tmp}/file/ckpt cannot be a folder: {tmp}/file is not one"
