"""nccl_rescale_nowait -- BUG version.

Source: OpenNMT/OpenNMT-py, onmt/utils/distributed.py::all_reduce_and_rescale_tensors,
issue OpenNMT/OpenNMT-py#2295 ("Bug in the all_reduce_and_rescale_tensors function"):
    torch.distributed.all_reduce(buffer_t[:offset], async_op=True)
    buffer_t.div_(rescale_denom)
The Work handle is dropped, so nothing orders the NCCL stream (which writes the
flat buffer) before the div_ / copy-back that run on the current (default) stream.
Single-process NCCL group (world_size=1), persistent flat buffer as in a trainer class.
"""
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PORT = 29601


class GradAllReducer:
    """OpenNMT-style all-reduce + rescale of gradients through one flat buffer."""

    def __init__(self, params, buffer_size=4 * 1024 * 1024):
        self.params = [p for p in params if p.requires_grad]
        elem = self.params[0].element_size()
        self.buffer_t = self.params[0].new_zeros(math.ceil(buffer_size / elem))

    def all_reduce_and_rescale(self, rescale_denom):
        buffer, filled = [], 0
        for p in self.params:
            g = p.grad
            if filled + g.numel() > self.buffer_t.numel():
                self._all_reduce_buffer(buffer, rescale_denom)
                buffer, filled = [], 0
            buffer.append(g)
            filled += g.numel()
        if buffer:
            self._all_reduce_buffer(buffer, rescale_denom)

    def _all_reduce_buffer(self, buffer, rescale_denom):
        # copy tensors into buffer_t
        offset = 0
        for t in buffer:
            numel = t.numel()
            self.buffer_t[offset:offset + numel].copy_(t.view(-1))
            offset += numel
        # all-reduce and rescale
        dist.all_reduce(self.buffer_t[:offset], async_op=True)  # Work handle dropped
        self.buffer_t.div_(rescale_denom)                        # races with the NCCL write
        # copy all-reduced buffer back into tensors
        offset = 0
        for t in buffer:
            numel = t.numel()
            t.view(-1).copy_(self.buffer_t[offset:offset + numel])
            offset += numel


def init_single_process_group(port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))


def main():
    init_single_process_group(PORT)
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(),
        nn.Linear(256, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reducer = GradAllReducer(model.parameters())
    world = float(dist.get_world_size())

    xs = [torch.randn(64, 256, device=dev) for _ in range(6)]
    ys = [torch.randint(0, 10, (64,), device=dev) for _ in range(6)]
    losses = []
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xs[step]), ys[step])
        loss.backward()
        reducer.all_reduce_and_rescale(world)
        opt.step()
        losses.append(loss.detach())

    torch.cuda.synchronize()
    print("losses:", [round(v, 4) for v in torch.stack(losses).tolist()])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
