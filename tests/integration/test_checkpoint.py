"""Checkpoints with real MindSpore: atomic commit, last K kept, corrupt ones skipped on resume."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn  # noqa: E402

from mselastic.trainer.checkpoint import Checkpointer, Manifest  # noqa: E402
from mselastic.trainer.tensors import host_copy  # noqa: E402
from mselastic.trainer.elastic import Session  # noqa: E402
from mselastic.trainer.faults import flip_byte  # noqa: E402


def test_a_manifest_reads_back_as_written_and_a_checkpoints_has_no_snapshot_fields() -> None:
    """``to_json`` writes the fields as they are (no deep copy: it runs at every snapshot)."""
    snap = Manifest(step=7, epoch=1, world_size=2, generation=3, file="ckpt-00000007-g000003.snap", sha256="",
                    size=12, extra={"num_samples": 100}, rng={"global_seed": 1, "kernel_seed": [["a", 0, 2]]},
                    lineage="x", tensors=[{"name": "w", "dtype": "float32", "shape": [3]}], crc32=5)
    assert Manifest(**json.loads(snap.to_json())) == snap
    ckpt = Manifest(step=7, epoch=1, world_size=2, generation=3, file="ckpt-00000007-g000003.ckpt", sha256="ab",
                    size=12)
    fields = json.loads(ckpt.to_json())
    assert "tensors" not in fields and "crc32" not in fields and Manifest(**fields) == ckpt


def make_opt(seed: int) -> nn.Momentum:
    ms.set_seed(seed)
    net = nn.Dense(4, 3)
    return nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)


def test_save_keep_and_fall_back_past_corruption(tmp_path: os.PathLike[str]) -> None:
    d = str(tmp_path)
    ck = Checkpointer(d, rank=0, world_size=2, generation=3, keep=2)
    for step in (10, 20, 30):
        m = ck.save(make_opt(step), step=step, epoch=0)
        assert m is not None and m.step == step and m.generation == 3 and m.world_size == 2
    assert ck.manifests() == ["ckpt-00000030-g000003.json", "ckpt-00000020-g000003.json"]  # last K kept
    assert not os.path.exists(os.path.join(d, "ckpt-00000010-g000003.ckpt"))
    with open(os.path.join(d, "latest.json")) as f:
        latest = json.load(f)
    assert latest.pop("lineage") and latest == {"manifest": "ckpt-00000030-g000003.json", "generation": 3, "job": ""}

    newest = ck.load()
    assert newest is not None and newest.manifest.step == 30 and not newest.skipped
    # The optimizer cell carries the weights, its momentum buffers, the step and the learning rate.
    assert {"weight", "bias", "moments.weight", "moments.bias", "global_step", "learning_rate"} <= set(newest.params)

    # Flip a byte in the middle of the newest checkpoint: its checksum fails, step 20 is used.
    flip_byte(os.path.join(d, "ckpt-00000030-g000003.ckpt"))
    fallback = Checkpointer(d, rank=1, world_size=2, generation=4).load()
    assert fallback is not None and fallback.manifest.step == 20
    assert [n for n, _ in fallback.skipped] == ["ckpt-00000030-g000003.json"]


def test_only_rank_zero_writes_and_empty_dir_is_a_fresh_start(tmp_path: os.PathLike[str]) -> None:
    d = str(tmp_path)
    assert Checkpointer(d, rank=1, world_size=2, generation=1).save(make_opt(1), step=5, epoch=0) is None
    assert os.listdir(d) == []
    assert Checkpointer(d, rank=0, world_size=2, generation=1).load() is None


def test_truncated_checkpoint_without_manifest_is_ignored(tmp_path: os.PathLike[str]) -> None:
    """A crash between writing the .ckpt and its manifest leaves an uncommitted file: never loaded."""
    d = str(tmp_path)
    ck = Checkpointer(d, rank=0, world_size=1, generation=1)
    ck.save(make_opt(1), step=10, epoch=0)
    with open(os.path.join(d, "ckpt-00000020-g000001.ckpt"), "wb") as f:
        f.write(b"partial")
    resumed = ck.load()
    assert resumed is not None and resumed.manifest.step == 10


def test_a_replaced_generation_cannot_publish_over_the_newer_one(tmp_path: os.PathLike[str]) -> None:
    """Split brain on shared storage: generation 1's rank 0, cut off and replaced, still saves
    after generation 2 loaded (and so claimed the directory). Its save is withdrawn; latest
    stays generation 2's; generation 3 resumes from generation 2's checkpoint."""
    d = str(tmp_path)
    old = Checkpointer(d, rank=0, world_size=2, generation=1, job="lenet")
    assert old.save(make_opt(1), step=10, epoch=0) is not None
    new = Checkpointer(d, rank=0, world_size=1, generation=2, job="lenet")
    resumed = new.load()  # claims the directory for generation 2
    assert resumed is not None and resumed.manifest.step == 10
    assert old.save(make_opt(2), step=20, epoch=0) is None  # withdrawn: no file of it is left
    assert not [n for n in os.listdir(d) if n.startswith("ckpt-00000020")]
    assert new.save(make_opt(3), step=15, epoch=0) is not None
    with open(os.path.join(d, "latest.json")) as f:
        latest = json.load(f)
    assert latest.pop("lineage") and latest == {"manifest": "ckpt-00000015-g000002.json", "generation": 2,
                                                "job": "lenet"}
    newest = Checkpointer(d, rank=1, world_size=2, generation=3, job="lenet").load()
    assert newest is not None and newest.manifest.step == 15 and newest.manifest.generation == 2
    # A replaced generation that starts late (its rank 0 loads after the claim) stops at once.
    with pytest.raises(SystemExit, match="generation 2 already owns"):
        Checkpointer(d, rank=0, world_size=2, generation=1, job="lenet").load()


def test_another_jobs_checkpoints_are_never_resumed(tmp_path: os.PathLike[str]) -> None:
    d = str(tmp_path)
    assert Checkpointer(d, rank=0, world_size=1, generation=4, job="a").save(make_opt(1), step=30, epoch=0)
    other = Checkpointer(d, rank=0, world_size=1, generation=1, job="b")
    assert other.load() is None  # job a's step-30 checkpoint is not b's to resume
    assert other.save(make_opt(2), step=5, epoch=0) is not None  # a was deleted: b takes the directory over
    assert Checkpointer(d, rank=0, world_size=1, generation=5, job="a").load() is not None  # a's own, kept


def test_checkpoints_that_all_fail_to_load_fail_loudly_instead_of_a_fresh_start(tmp_path: os.PathLike[str]) -> None:
    d = str(tmp_path)
    w = Checkpointer(d, rank=0, world_size=1, generation=1, job="j")
    for step in (10, 20):
        assert w.save(make_opt(step), step=step, epoch=0) is not None
    for name in os.listdir(d):
        if name.endswith(".ckpt"):
            flip_byte(os.path.join(d, name))
    with pytest.raises(SystemExit) as e:
        Checkpointer(d, rank=0, world_size=1, generation=2, job="j").load()
    assert "none can be resumed from" in str(e.value) and "ckpt-00000020-g000001.json: checksum mismatch" in str(e.value)
    assert "ckpt-00000010-g000001.json: checksum mismatch" in str(e.value)
    assert len([n for n in os.listdir(d) if n.endswith(".ckpt")]) == 2  # nothing pruned


def test_random_state_is_restored_so_dropout_continues_as_if_never_interrupted(tmp_path: os.PathLike[str]) -> None:
    """Functional dropout takes its seeds from MindSpore's per-operator counters: the manifest
    carries them, and a resumed process draws the masks an uninterrupted one would have."""
    from mindspore import ops

    def masks(n: int) -> list[bytes]:
        x = ms.Tensor(ms.numpy.ones((64,), ms.float32))
        return [ops.dropout(x, p=0.5, training=True).asnumpy().tobytes() for _ in range(n)]

    d, opt = str(tmp_path), make_opt(1)
    ms.set_seed(7)
    masks(3)
    assert Checkpointer(d, rank=0, world_size=1, generation=1, job="j").save(opt, step=3, epoch=0) is not None
    expected = masks(4)  # the uninterrupted run goes on
    ms.set_seed(7)  # a fresh process: seeded again, nothing drawn yet
    resumed = Checkpointer(d, rank=0, world_size=1, generation=2, job="j").load()
    assert resumed is not None and resumed.manifest.rng["kernel_seed"]
    assert masks(4) == expected
    ms.set_seed(7)
    assert masks(4) != expected  # without the restore the masks differ (the test can fail)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_its_litter_is_swept(tmp_path: os.PathLike[str]) -> None:
    d = str(tmp_path)
    w = Checkpointer(d, rank=0, world_size=1, generation=1, job="j")
    assert w.save(make_opt(1), step=10, epoch=0) is not None
    # What a SIGKILL inside the save of step 20 leaves: its parameters, half a manifest in a temp file.
    ms.save_checkpoint(make_opt(2), os.path.join(d, "ckpt-00000020-g000001.ckpt"))
    with open(os.path.join(d, "ckpt-00000020-g000001.json.tmp.12345"), "w") as f:
        f.write('{"step": 20, "epo')
    resumed = Checkpointer(d, rank=0, world_size=1, generation=2, job="j").load()
    assert resumed is not None and resumed.manifest.step == 10
    assert sorted(os.listdir(d)) == [".latest.lock", "ckpt-00000010-g000001.ckpt", "ckpt-00000010-g000001.json",
                                     "latest.json"]


def test_a_snapshot_is_whole_when_taken_even_while_a_checkpoint_is_written(tmp_path: os.PathLike[str]) -> None:
    """A rank may be SIGKILLed the moment ``snapshot`` returns: its snapshot is in the node's memory by
    then, also while MindSpore writes a checkpoint in the background (one at a time: a snapshot
    written through it waited, and the ones due meanwhile were skipped — two steps lost in CI).
    The next generation resumes from it with the very values it was taken with."""
    d, snaps = os.path.join(str(tmp_path), "ckpt"), os.path.join(str(tmp_path), "snap")
    os.makedirs(snaps)
    net = nn.SequentialCell([nn.Dense(1024, 1024) for _ in range(4)])  # 16 MiB, twice with the moments
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    s = Session()
    s.tracked = [opt]
    s.ckpt = Checkpointer(d, rank=0, world_size=1, generation=1, job="j", snapshot_dir=snaps, snapshot_interval=1,
                          keeper=True)
    assert s.ckpt.load() is None  # claims the folder (and its lineage)
    s.save(10)  # written by a background thread
    assert s.ckpt.snapshot(opt, step=11, epoch=0, cursor=88)
    assert sorted(os.listdir(snaps)) == ["ckpt-00000011-g000001.json", "ckpt-00000011-g000001.snap"]
    taken = {v["name"]: v["data"] for v in host_copy([opt])}
    s.wait_saved()
    resumed = Checkpointer(d, rank=0, world_size=1, generation=2, job="j", snapshot_dir=snaps).load()
    assert resumed is not None and resumed.manifest.step == 11 and resumed.manifest.cursor == 88
    assert sorted(resumed.params) == sorted(taken)
    assert all(np.array_equal(resumed.params[k].asnumpy(), taken[k]) for k in taken)


def test_a_snapshot_keeps_every_dtype_and_shape_and_a_failed_one_leaves_nothing(tmp_path: os.PathLike[str]) -> None:
    """Raw bytes, then a MindSpore checkpoint on adoption: bfloat16 (numpy has no such type), float16,
    integers, booleans and 0-d values come back as they were. A snapshot that cannot be written
    leaves no file in the node's memory (it would pile up, one per step)."""
    d, snaps = os.path.join(str(tmp_path), "ckpt"), os.path.join(str(tmp_path), "snap")
    os.makedirs(snaps)
    g1 = Checkpointer(d, rank=0, world_size=1, generation=1, job="j", snapshot_dir=snaps, snapshot_interval=1,
                      keeper=True, snapshot_budget=None)
    assert g1.load() is None
    values = {"bf": ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)).astype(ms.bfloat16),
              "half": ms.Tensor(np.array([0.5, -2.0], dtype=np.float16)), "count": ms.Tensor(np.array(7, np.int32)),
              "mask": ms.Tensor(np.array([True, False])), "lr": ms.Tensor(np.array(0.25, np.float32))}

    class State(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            for name, value in values.items():
                setattr(self, name, ms.Parameter(value, name=name))

    class Broken:  # its values cannot be read: the write fails halfway
        def get_parameters(self) -> list[object]:
            return [ms.Parameter(values["half"], name="half"), type("P", (), {"name": "x"})()]

    assert g1.snapshot(State(), step=3, epoch=0)
    assert not g1.snapshot(Broken(), step=4, epoch=0)
    assert sorted(os.listdir(snaps)) == ["ckpt-00000003-g000001.json", "ckpt-00000003-g000001.snap"]
    resumed = Checkpointer(d, rank=0, world_size=1, generation=2, job="j", snapshot_dir=snaps).load()
    assert resumed is not None and resumed.manifest.step == 3
    for name, value in values.items():
        got = resumed.params[name]
        assert got.dtype == value.dtype and got.shape == value.shape, (name, got.dtype, got.shape)
        assert np.array_equal(got.float().asnumpy() if value.dtype == ms.bfloat16 else got.asnumpy(),
                              value.float().asnumpy() if value.dtype == ms.bfloat16 else value.asnumpy()), name


def test_snapshots_take_at_most_their_share_of_the_training_thread(tmp_path: os.PathLike[str]) -> None:
    """#49: a snapshot is kept only once the training since the last one has run 1/SNAPSHOT_BUDGET
    times what that one cost (each is timed): a model whose copy is a large share of its step gets
    one every few steps; the first is always taken, and a quick one every step."""
    import time

    from mselastic.trainer.checkpoint import SNAPSHOT_BUDGET

    d, snaps = os.path.join(str(tmp_path), "ckpt"), os.path.join(str(tmp_path), "snap")
    os.makedirs(snaps)
    ck = Checkpointer(d, rank=0, world_size=1, generation=1, job="j", snapshot_dir=snaps, snapshot_interval=1,
                      keeper=True)
    assert ck.load() is None
    opt = make_opt(1)
    assert ck.snapshot(opt, step=1, epoch=0)  # the first: it measures
    assert ck._last_snapshot is not None and ck._last_snapshot[0] == 1 and ck._last_snapshot[1] > 0
    # As if that one had taken 0.1 s and ended just now: training must run 2 s before the next.
    ck._last_snapshot = (1, 0.1, time.monotonic())
    assert not ck.snapshot(opt, step=2, epoch=0) and not ck.snapshot(opt, step=3, epoch=0)
    ck._last_snapshot = (1, 0.1, time.monotonic() - 0.1 / SNAPSHOT_BUDGET)
    assert ck.snapshot(opt, step=4, epoch=0)
    assert sorted(n for n in os.listdir(snaps) if n.endswith(".json")) == ["ckpt-00000001-g000001.json",
                                                                          "ckpt-00000004-g000001.json"]


def test_a_snapshot_newer_than_every_checkpoint_becomes_one_and_only_the_owners(tmp_path: os.PathLike[str]) -> None:
    """Snapshots (the node's memory) between checkpoints: the next generation's rank 0 keeps the
    newest as an ordinary checkpoint, loadable by plain MindSpore, when it is newer than every
    checkpoint and the generation that took it owns the folder; never a replaced generation's."""
    d, snaps = os.path.join(str(tmp_path), "ckpt"), os.path.join(str(tmp_path), "snap")
    os.makedirs(snaps)
    g1 = Checkpointer(d, rank=0, world_size=2, generation=1, job="j", snapshot_dir=snaps, snapshot_interval=1,
                      keeper=True, snapshot_budget=None)  # (one every step, however quick the calls)
    assert g1.load() is None  # claims the folder for generation 1
    g1.save(make_opt(10), step=10, epoch=0)
    for step in (11, 12, 13):
        assert g1.snapshot(make_opt(step), step=step, epoch=0, cursor=step * 8)
    assert sorted(os.listdir(snaps)) == [f"ckpt-000000{s}-g000001.{x}" for s in (12, 13) for x in ("json", "snap")]
    # A rank that is not its node's first takes none; nor does one when none is due.
    other = Checkpointer(d, rank=1, world_size=2, generation=1, job="j", snapshot_dir=snaps, snapshot_interval=1)
    assert not other.snapshot(make_opt(14), step=14, epoch=0)
    assert not Checkpointer(d, 0, 2, 1, job="j", snapshot_dir=snaps, snapshot_interval=5,
                            keeper=True).snapshot(make_opt(14), step=14, epoch=0)

    # The newest one is damaged in memory (its CRC fails): the one before is kept instead.
    flip_byte(os.path.join(snaps, "ckpt-00000013-g000001.snap"))
    g2 = Checkpointer(d, rank=0, world_size=1, generation=2, job="j", snapshot_dir=snaps)
    resumed = g2.load()
    assert resumed is not None and resumed.manifest.step == 12 and resumed.manifest.cursor == 96
    assert ms.load_checkpoint(os.path.join(d, "ckpt-00000012-g000001.ckpt"))["weight"].shape == (3, 4)
    with open(os.path.join(d, "ckpt-00000012-g000001.json")) as f:
        assert len(json.load(f)["sha256"]) == 64
    assert not [n for n in os.listdir(d) if n.startswith("ckpt-00000013")]
    # Not newer than the newest checkpoint: nothing is adopted, the checkpoint is resumed from.
    g2.save(make_opt(20), step=20, epoch=0)
    assert Checkpointer(d, rank=0, world_size=1, generation=3, job="j", snapshot_dir=snaps).load().manifest.step == 20

    # Generation 3 owns the folder now; a snapshot that generation 2 (replaced, training on while
    # cut off) took later is not adopted by generation 4.
    late = Checkpointer(d, rank=0, world_size=1, generation=2, job="j", snapshot_dir=snaps, snapshot_interval=1,
                        keeper=True)
    late._lineage = g1._lineage
    late._write_snapshot({"w": ms.Tensor([1.0])}, 30, 0, 0, 0, {}, {})
    assert Checkpointer(d, rank=0, world_size=1, generation=4, job="j", snapshot_dir=snaps).load().manifest.step == 20
    assert not os.path.exists(os.path.join(d, "ckpt-00000030-g000002.json"))

    # The same job name with another checkpoint folder (another checkpoint_dir, or an etcd wiped
    # since): the snapshots on the node continue another history and are not adopted.
    elsewhere = os.path.join(str(tmp_path), "ckpt2")
    fresh = Checkpointer(elsewhere, rank=0, world_size=1, generation=1, job="j")
    assert fresh.load() is None
    fresh.save(make_opt(1), step=1, epoch=0)
    again = Checkpointer(elsewhere, rank=0, world_size=1, generation=9, job="j", snapshot_dir=snaps).load()
    assert again is not None and again.manifest.step == 1
