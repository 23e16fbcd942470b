"""LeNet on MNIST-format digits, data parallel, made elastic with a few lines.

The seed example (``ds.MnistDataset`` sharded over the ranks, ``DATA_PARALLEL`` with
``gradients_mean=True``, ``DistributedGradReducer``, ``Momentum(lr, 0.9)``,
``value_and_grad``) is unchanged in spirit; the lines marked ``# elastic`` are
what mselastic adds: join through ``ElasticContext.init()``, resume from the
newest valid checkpoint (parameters, momentum, learning-rate step, data position),
shard with ``DistributedSampler(num_shards, shard_id)`` from the checkpoint's sample
cursor so every sample of an epoch is used exactly once at any world size, keep
the global batch with gradient accumulation, heartbeat every step, checkpoint
every N steps and at the step all ranks agree on after a SIGTERM. Runs under
elasticd, or under plain msrun with the defaults below.

Usage: msrun --worker_num=2 --local_worker_num=2 train.py --data DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

from mselastic.trainer import Checkpointer, ElasticContext, ElasticData  # elastic

ctx = ElasticContext.init(checkpoint_dir="/tmp/lenet-ckpt", total_steps=200, global_batch_size=32)  # elastic

import mindspore as ms  # noqa: E402  (after init: the scheduler stops inside init)
import mindspore.dataset as ds  # noqa: E402
import mindspore.dataset.transforms as T  # noqa: E402
import mindspore.dataset.vision as V  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import nn, ops  # noqa: E402
from mindspore.common.initializer import Normal  # noqa: E402

SEED = 1234


class LeNet5(nn.Cell):
    def __init__(self, num_class: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
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
        x = self.relu(self.fc1(x))
        if self.dropout:  # functional: its seeds are MindSpore's counters, which checkpoints carry
            x = ops.dropout(x, p=self.dropout, training=self.training)
        x = self.relu(self.fc2(x))
        if self.dropout:
            x = ops.dropout(x, p=self.dropout, training=self.training)
        return self.fc3(x)


N_TRAIN = 1497  # rows in train-images-idx3-ubyte (examples/lenet/make_data.py)


def transform(d: ds.Dataset, batch: int) -> ds.Dataset:
    d = d.map([V.Rescale(1.0 / 255.0, 0.0), V.Normalize((0.1307,), (0.3081,)), V.HWC2CHW()], "image")
    d = d.map(T.TypeCast(ms.int32), "label")
    return d.batch(batch, drop_remainder=True)


def train_batches(data_dir: str, data: ElasticData, pos, with_ids: bool) -> ds.Dataset:  # type: ignore[no-untyped-def]
    """This rank's micro-batches for the rest of the epoch (image, label[, sample id])."""
    d = ds.MnistDataset(data_dir, usage="train", sampler=data.sampler(pos))  # elastic: sampler, not num_shards
    if with_ids:  # the same sampler over the row numbers: which samples this rank consumed
        ids = ds.NumpySlicesDataset({"id": np.arange(N_TRAIN, dtype=np.int32)}, sampler=data.sampler(pos))
        d = ds.zip((d, ids))
    return transform(d, ctx.micro_batch)


def evaluate(net: nn.Cell, data: str, until: float) -> float:
    """Accuracy on the test set, passes over it until ``until`` (monotonic): an evaluation pass of
    a chosen length, on this rank alone (the others wait for it in the next step's collective)."""
    net.set_train(False)
    correct = total = 0
    while time.monotonic() < until:
        for x, y in transform(ds.MnistDataset(data, usage="test", shuffle=False), 100).create_tuple_iterator(
                num_epochs=1):
            correct += int((net(x).asnumpy().argmax(axis=1) == y.asnumpy()).sum())
            total += int(y.shape[0])
            if time.monotonic() >= until:
                break
    net.set_train(True)
    return correct / max(total, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="results and final parameters go here")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--record-samples", action="store_true",
                   help="append the sample ids each rank consumes to OUT/samples_g<G>_r<R>.jsonl")
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="pause after each step (tests pace the run)")
    p.add_argument("--pace-until", metavar="PATH", default="",
                   help="pause --step-sleep-s only until PATH exists (a test keeps the job running while it "
                        "needs it, then lets it finish at full speed)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout after the hidden layers (0: none)")
    p.add_argument("--first-step-s", type=float, default=0.0,
                   help="the job's first step takes this long (as a long graph compile would, with no cache yet)")
    p.add_argument("--save-s", type=float, default=0.0,
                   help="each checkpoint save takes this long on the rank that writes it (the others wait for it)")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="rank 0 evaluates the test set every N steps, for --eval-s seconds (the others wait)")
    p.add_argument("--eval-s", type=float, default=5.0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(SEED)

    net = LeNet5(dropout=args.dropout)
    net.set_train(True)
    # A schedule computed from global_step, not a per-step list: the list would be saved with the
    # optimizer and a resume with another total_steps (a job submitted again to train longer)
    # could not load it.
    lr = nn.CosineDecayLR(args.lr / 10, args.lr, ctx.total_steps)
    opt = nn.Momentum(net.trainable_params(), learning_rate=lr, momentum=0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    reducer = nn.DistributedGradReducer(opt.parameters)

    ckpt = Checkpointer.from_context(ctx)  # elastic
    resumed = ckpt.load()  # elastic
    start = 0
    if resumed is not None:  # elastic
        ms.load_param_into_net(opt, resumed.params)  # weights, momentum buffers, global_step
        start = resumed.manifest.step
    data = ElasticData(ctx, N_TRAIN, SEED)  # elastic
    pos = data.start(resumed)  # elastic: epoch, seed, global sample cursor
    ctx.started(start, resumed.note if resumed else "")  # elastic
    record = open(os.path.join(args.out, f"samples_g{ctx.generation}_r{ctx.rank}.jsonl"), "a") \
        if args.record_samples else None

    step, loss = start, float("nan")
    while step < ctx.total_steps:
        it = train_batches(args.data, data, pos, record is not None).create_tuple_iterator(num_epochs=1)
        for _ in range(min(data.steps_left(pos), ctx.total_steps - step)):
            grads, losses, ids = None, [], []
            for _ in range(ctx.accumulation_steps):  # elastic: the global batch stays the same
                x, y, *rest = next(it)
                micro_loss, g = grad_fn(x, y)
                grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
                losses.append(float(micro_loss.asnumpy()))
                ids += rest[0].asnumpy().tolist() if rest else []
            if ctx.accumulation_steps > 1:
                grads = tuple(g / ctx.accumulation_steps for g in grads)
            opt(reducer(grads))
            step, pos, loss = step + 1, data.advance(pos), sum(losses) / len(losses)
            if record is not None:
                record.write(json.dumps({"step": step, "rank": ctx.rank, "world": ctx.world_size, "ids": ids,
                                         "at": round(time.time(), 3)}) + "\n")
                record.flush()
            if step == 1 and args.first_step_s:
                time.sleep(args.first_step_s)
            ctx.beat("step", step, loss)  # elastic
            if step % 10 == 0 or step == start + 1:  # what `elasticctl logs -f` shows
                print(f"step {step}/{ctx.total_steps} loss {loss:.4f} world_size {ctx.world_size}", flush=True)
            if args.step_sleep_s and not (args.pace_until and os.path.exists(args.pace_until)):
                time.sleep(args.step_sleep_s)
            stop = ctx.should_stop(step)  # elastic: a planned stop: every rank stops at the step elasticd named
            if step % ctx.checkpoint_interval_steps == 0 or step == ctx.total_steps or stop:  # elastic
                if args.save_s and ckpt.writer:  # (a large model's save: nothing is written until it is over)
                    time.sleep(args.save_s)
                ckpt.save(opt, step, pos.epoch, pos.cursor, pos.seed)
                if stop:
                    ctx.planned_exit(step)
            else:  # elastic: between checkpoints, a snapshot in this node's memory (a crash loses <= 1 step)
                ckpt.snapshot(opt, step, pos.epoch, pos.cursor, pos.seed)
            if args.eval_every and step % args.eval_every == 0 and ctx.rank == 0:
                evaluate(net, args.data, time.monotonic() + args.eval_s)

    np.savez(os.path.join(args.out, f"params_rank{ctx.rank}.npz"),
             **{p.name: p.asnumpy() for p in net.trainable_params()})
    if ctx.rank == 0:
        net.set_train(False)
        correct = total = 0
        test = transform(ds.MnistDataset(args.data, usage="test", shuffle=False), 100)
        for x, y in test.create_tuple_iterator(num_epochs=1):
            pred = net(x).asnumpy().argmax(axis=1)
            correct += int((pred == y.asnumpy()).sum())
            total += len(pred)
        result = {"final_step": step, "loss": loss, "accuracy": correct / total, "resumed_from": start,
                  "generation": ctx.generation, "world_size": ctx.world_size,
                  "global_step": int(opt.global_step.asnumpy()[0])}
        with open(os.path.join(args.out, f"result_g{ctx.generation}.json"), "w") as f:
            json.dump(result, f)
        print("RESULT", json.dumps(result), flush=True)
    ctx.finished(step, loss)  # elastic


if __name__ == "__main__":
    main()
