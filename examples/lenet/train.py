"""LeNet on MNIST-format digits, data parallel, made elastic with a few lines.

The seed example (``ds.MnistDataset(num_shards, shard_id)``, ``DATA_PARALLEL`` with
``gradients_mean=True``, ``DistributedGradReducer``, ``Momentum(0.01, 0.9)``,
``value_and_grad``) is unchanged in spirit; the lines marked ``# elastic`` are
what mselastic adds: join through ``ElasticContext.init()``, resume from the
newest valid checkpoint, heartbeat every step, checkpoint every N steps and on
SIGTERM. Runs under elasticd, or under plain msrun with ``--checkpoint-dir``.

Usage: msrun --worker_num=2 --local_worker_num=2 train.py --data DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

from mselastic.trainer import Checkpointer, ElasticContext  # elastic

ctx = ElasticContext.init(checkpoint_dir="/tmp/lenet-ckpt", total_steps=200, global_batch_size=32)  # elastic

import mindspore as ms  # noqa: E402  (after init: the scheduler stops inside init)
import mindspore.dataset as ds  # noqa: E402
import mindspore.dataset.transforms as T  # noqa: E402
import mindspore.dataset.vision as V  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.common.initializer import Normal  # noqa: E402

SEED = 1234


class LeNet5(nn.Cell):
    def __init__(self, num_class: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, pad_mode="valid")
        self.conv2 = nn.Conv2d(6, 16, 5, pad_mode="valid")
        self.fc1 = nn.Dense(16 * 4 * 4, 120, weight_init=Normal(0.02))
        self.fc2 = nn.Dense(120, 84, weight_init=Normal(0.02))
        self.fc3 = nn.Dense(84, num_class, weight_init=Normal(0.02))
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()

    def construct(self, x):  # type: ignore[no-untyped-def]
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.flatten(x)
        return self.fc3(self.relu(self.fc2(self.relu(self.fc1(x)))))


def dataset(data_dir: str, usage: str, batch: int, shard: tuple[int, int] | None, epoch: int) -> ds.Dataset:
    ds.config.set_seed(SEED + epoch)  # the same shuffle on every rank and on every resume of this epoch
    kwargs = dict(num_shards=shard[0], shard_id=shard[1]) if shard else {}
    d = ds.MnistDataset(data_dir, usage=usage, shuffle=usage == "train", **kwargs)
    d = d.map([V.Rescale(1.0 / 255.0, 0.0), V.Normalize((0.1307,), (0.3081,)), V.HWC2CHW()], "image")
    d = d.map(T.TypeCast(ms.int32), "label")
    return d.batch(batch, drop_remainder=usage == "train")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="results and final parameters go here")
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(SEED)

    net = LeNet5()
    opt = nn.Momentum(net.trainable_params(), learning_rate=args.lr, momentum=0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    reducer = nn.DistributedGradReducer(opt.parameters)

    def train_step(x, y):  # type: ignore[no-untyped-def]
        loss, grads = grad_fn(x, y)
        opt(reducer(grads))
        return loss

    ckpt = Checkpointer.from_context(ctx)  # elastic
    resumed = ckpt.load()  # elastic
    start = 0
    if resumed is not None:  # elastic
        ms.load_param_into_net(opt, resumed.params)
        start = resumed.manifest.step
    ctx.started(start, resumed.note if resumed else "")  # elastic

    n_train = 1497  # rows in train-images-idx3-ubyte (examples/lenet/make_data.py)
    steps_per_epoch = (n_train // ctx.device_num) // ctx.per_rank_batch
    epoch, offset = divmod(start, steps_per_epoch)
    it = dataset(args.data, "train", ctx.per_rank_batch, (ctx.num_shards, ctx.shard_id), epoch) \
        .skip(offset).create_tuple_iterator(num_epochs=1)
    step, loss = start, float("nan")
    while step < ctx.total_steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            it = dataset(args.data, "train", ctx.per_rank_batch, (ctx.num_shards, ctx.shard_id), epoch) \
                .create_tuple_iterator(num_epochs=1)
            continue
        loss = float(train_step(x, y).asnumpy())
        step += 1
        ctx.beat("step", step, loss)  # elastic
        if step % ctx.checkpoint_interval_steps == 0 or step == ctx.total_steps or ctx.stop_requested:  # elastic
            ckpt.save(opt, step, epoch)
            if ctx.stop_requested:
                ctx.planned_exit(step)

    np.savez(os.path.join(args.out, f"params_rank{ctx.rank}.npz"),
             **{p.name: p.asnumpy() for p in net.trainable_params()})
    if ctx.rank == 0:
        correct = total = 0
        for x, y in dataset(args.data, "test", 100, None, 0).create_tuple_iterator(num_epochs=1):
            pred = net(x).asnumpy().argmax(axis=1)
            correct += int((pred == y.asnumpy()).sum())
            total += len(pred)
        result = {"final_step": step, "loss": loss, "accuracy": correct / total, "resumed_from": start,
                  "generation": ctx.generation, "world_size": ctx.device_num}
        with open(os.path.join(args.out, f"result_g{ctx.generation}.json"), "w") as f:
            json.dump(result, f)
        print("RESULT", json.dumps(result), flush=True)
    ctx.finished(step, loss)  # elastic


if __name__ == "__main__":
    main()
