"""The torchrun side of ``bench/recovery.py``: the same LeNet job in PyTorch (DDP, gloo, CPU).

Reads the digits data set in MNIST's IDX format (``make data``), trains LeNet-5 data parallel
with a global batch of 32 split over the ranks, checkpoints every 10 steps (rank 0, temp file and
rename) and resumes from the newest checkpoint when torchrun restarts the workers. Each rank
sends a datagram per step to the abstract unix socket named in ``BENCH_BEAT``: what the bench
times a restart by (kill -> first step of the next restart), as it does for mselastic.

Runs only in the bench's own environment (``build/bench-venv``, torch CPU): never in ``make test``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def idx(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


class LeNet5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5, bias=False), nn.Conv2d(6, 16, 5, bias=False)
        self.fc1, self.fc2, self.fc3 = nn.Linear(256, 120), nn.Linear(120, 84), nn.Linear(84, 10)
        self.pool, self.relu = nn.MaxPool2d(2), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = x.flatten(1)
        return self.fc3(self.relu(self.fc2(self.relu(self.fc1(x)))))


def main() -> None:
    data, ckpt_dir, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    beat = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = "\0" + os.environ["BENCH_BEAT"]
    torch.manual_seed(1234)
    images = torch.tensor(idx(os.path.join(data, "train-images-idx3-ubyte")), dtype=torch.float32)[:, None] / 255
    labels = torch.tensor(idx(os.path.join(data, "train-labels-idx1-ubyte")), dtype=torch.int64)
    net = DistributedDataParallel(LeNet5())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    step = 0
    latest = os.path.join(ckpt_dir, "latest.pt")
    if os.path.exists(latest):
        state = torch.load(latest)
        net.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    per_rank = 32 // world
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(1))
    while step < total:
        start = (step * 32) % (len(images) - 32)
        batch = order[start + rank * per_rank: start + (rank + 1) * per_rank]
        loss = nn.functional.cross_entropy(net(images[batch]), labels[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        beat.sendto(json.dumps({"rank": rank, "step": step, "restart": restart, "pid": os.getpid(),
                                "at": time.time()}).encode(), address)
        if step % 10 == 0 and rank == 0:
            tmp = latest + ".tmp"
            torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, latest)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
