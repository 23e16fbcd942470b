"""Checkpoints with real MindSpore: atomic commit, last K kept, corrupt ones skipped on resume."""

from __future__ import annotations

import json
import os

import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn  # noqa: E402

from mselastic.trainer.checkpoint import Checkpointer  # noqa: E402


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
    assert ck.manifests() == ["ckpt-00000030.json", "ckpt-00000020.json"]  # last K kept
    assert not os.path.exists(os.path.join(d, "ckpt-00000010.ckpt"))
    with open(os.path.join(d, "latest.json")) as f:
        assert json.load(f) == {"manifest": "ckpt-00000030.json"}

    newest = ck.load()
    assert newest is not None and newest.manifest.step == 30 and not newest.skipped
    # The optimizer cell carries the weights, its momentum buffers, the step and the learning rate.
    assert {"weight", "bias", "moments.weight", "moments.bias", "global_step", "learning_rate"} <= set(newest.params)

    # Flip a byte in the middle of the newest checkpoint: its checksum fails, step 20 is used.
    path = os.path.join(d, "ckpt-00000030.ckpt")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    fallback = Checkpointer(d, rank=1, world_size=2, generation=4).load()
    assert fallback is not None and fallback.manifest.step == 20
    assert [n for n, _ in fallback.skipped] == ["ckpt-00000030.json"]


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
    with open(os.path.join(d, "ckpt-00000020.ckpt"), "wb") as f:
        f.write(b"partial")
    resumed = ck.load()
    assert resumed is not None and resumed.manifest.step == 10
