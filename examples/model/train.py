"""LeNet on MNIST with ``Model.train``, data parallel, made elastic: two lines added to the way
MindSpore's tutorials train (marked ``# elastic``), plus ``elastic.Callback()`` in the callbacks.

Resumes before the first step (weights, momentum, step, data position), checkpoints every
``checkpoint_interval_steps`` and at a planned stop, reports a heartbeat each step (each sink in
data sink mode) and ends at the job's ``total_steps``. ``--sink`` trains in data sink mode,
``--amp-level`` sets ``Model``'s mixed precision.

Usage: elasticctl submit job.toml   (or: msrun --worker_num=2 --local_worker_num=2 train.py DATA_DIR OUT_DIR)
"""

from mselastic.trainer import elastic  # elastic
import argparse
import json
import os

import mindspore as ms
import mindspore.dataset as ds
import mindspore.dataset.transforms as T
import mindspore.dataset.vision as V
import numpy as np
from mindspore import nn
from mindspore.common.initializer import Normal
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import FixedLossScaleManager, LossMonitor, Model

parser = argparse.ArgumentParser()
parser.add_argument("data_dir")
parser.add_argument("out_dir")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--sink", action="store_true", help="dataset_sink_mode=True")
parser.add_argument("--amp-level", default="O0", choices=["O0", "O1", "O2", "O3"])
parser.add_argument("--mode", choices=["graph", "pynative"], default="graph")
args = parser.parse_args()

ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)
init()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
ms.set_seed(1234)
rank_id, rank_size = get_rank(), get_group_size()


class LeNet5(nn.Cell):
    def __init__(self, num_class=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, pad_mode="valid")
        self.conv2 = nn.Conv2d(6, 16, 5, pad_mode="valid")
        self.fc1 = nn.Dense(16 * 4 * 4, 120, weight_init=Normal(0.02))
        self.fc2 = nn.Dense(120, 84, weight_init=Normal(0.02))
        self.fc3 = nn.Dense(84, num_class, weight_init=Normal(0.02))
        self.relu = nn.ReLU()
        self.max_pool2d = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()

    def construct(self, x):
        x = self.max_pool2d(self.relu(self.conv1(x)))
        x = self.max_pool2d(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def create_dataset(batch_size):
    dataset = ds.MnistDataset(args.data_dir, usage="train", num_shards=rank_size, shard_id=rank_id, shuffle=True)
    image_transforms = [V.Rescale(1.0 / 255.0, 0), V.Normalize(mean=(0.1307,), std=(0.3081,)), V.HWC2CHW()]
    dataset = dataset.map(image_transforms, "image").map(T.TypeCast(ms.int32), "label")
    return dataset.batch(batch_size, drop_remainder=True)


dataset = create_dataset(16)
dataset = elastic.data(dataset)  # elastic
net = LeNet5()
loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
# O2/O3 keep the weights in float32 and scale the loss: on CPU only a fixed scale is supported.
loss_scale = FixedLossScaleManager(drop_overflow_update=False) if args.amp_level in ("O2", "O3") else None
model = Model(net, loss_fn=loss_fn, optimizer=optimizer, amp_level=args.amp_level, loss_scale_manager=loss_scale)
model.train(args.epochs, dataset, callbacks=[LossMonitor(10), elastic.Callback()],  # elastic: the callback
            dataset_sink_mode=args.sink)

os.makedirs(args.out_dir, exist_ok=True)
np.savez(os.path.join(args.out_dir, f"params_rank{rank_id}.npz"),
         **{p.name: p.asnumpy() for p in net.trainable_params()})
with open(os.path.join(args.out_dir, f"done_rank{rank_id}.json"), "w") as f:
    json.dump({"world_size": rank_size, "step": elastic.session().step}, f)
