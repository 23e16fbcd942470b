"""train.py with its loop written for elastic training: ``elastic.batches(dataset)`` yields every
step of the job across epochs (it ends at the job's ``total_steps``) and ``elastic.step(loss)``
gives the heartbeats the loss (``elasticctl watch`` shows it).

Usage: elasticctl submit job.toml   (or: msrun --worker_num=2 --local_worker_num=2 loop.py DATA_DIR OUT_DIR)
"""

from mselastic.trainer import elastic
import json
import os
import sys

import mindspore as ms
import mindspore.dataset as ds
import mindspore.dataset.transforms as T
import mindspore.dataset.vision as V
import numpy as np
from mindspore import nn
from mindspore.common.initializer import Normal
from mindspore.communication import get_group_size, get_rank, init

ms.set_context(mode=ms.GRAPH_MODE)
init()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
ms.set_seed(1234)
rank_id, rank_size = get_rank(), get_group_size()
data_dir, out_dir = sys.argv[1], sys.argv[2]
epochs, batch_size = 10, 16


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
    dataset = ds.MnistDataset(data_dir, usage="train", num_shards=rank_size, shard_id=rank_id, shuffle=True)
    image_transforms = [V.Rescale(1.0 / 255.0, 0), V.Normalize(mean=(0.1307,), std=(0.3081,)), V.HWC2CHW()]
    dataset = dataset.map(image_transforms, "image").map(T.TypeCast(ms.int32), "label")
    return dataset.batch(batch_size, drop_remainder=True)


dataset = create_dataset(batch_size)
net = LeNet5()
loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
elastic.track(optimizer)


def forward_fn(data, label):
    return loss_fn(net(data), label)


grad_fn = ms.value_and_grad(forward_fn, None, optimizer.parameters)
grad_reducer = nn.DistributedGradReducer(optimizer.parameters)


@ms.jit
def train_step(data, label):
    loss, grads = grad_fn(data, label)
    optimizer(grad_reducer(grads))
    return loss


for data, label in elastic.batches(dataset):
    loss = train_step(data, label)
    elastic.step(loss)
print(f"rank {rank_id}: loss {loss}", flush=True)

os.makedirs(out_dir, exist_ok=True)
np.savez(os.path.join(out_dir, f"params_rank{rank_id}.npz"), **{p.name: p.asnumpy() for p in net.trainable_params()})
with open(os.path.join(out_dir, f"done_rank{rank_id}.json"), "w") as f:
    json.dump({"loss": float(loss.asnumpy()), "world_size": rank_size}, f)
