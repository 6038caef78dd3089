"""nccl_synchronize_host_staging -- BUG version.

Source: pytorch/pytorch#147309 ("Why doesn't work.wait work?"): maintainers point out
that for NCCL, work.wait() does not sync the CPU.  ProcessGroupNCCL.cpp:
WorkNCCL::synchronize() -> synchronizeStream() only does
ncclEndEvent_->block(currentStream); wait() is the same unless a timeout /
TORCH_NCCL_BLOCKING_WAIT is given.  Pattern: a metrics aggregator that stages
host-side counters in a pinned buffer, uploads them with a non_blocking H2D copy,
all-reduces, and keeps the running total on the GPU to avoid a per-step sync.
The author assumed work.synchronize() blocks the host, so the pinned staging
buffer is overwritten by the CPU on the next step while the H2D copy that reads
it may still be pending on the default stream.
"""
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PORT = 29602


class StepMetricsAllReducer:
    def __init__(self, names, device):
        self.names = names
        self.stage = torch.zeros(len(names), dtype=torch.float32, pin_memory=True)
        self.stage_np = self.stage.numpy()          # host view of the pinned buffer
        self.dev = torch.zeros(len(names), device=device)
        self.total = torch.zeros(len(names), device=device)
        self.steps = 0

    def push(self, values):
        self.stage_np[:] = values                       # host writes pinned staging
        self.dev.copy_(self.stage, non_blocking=True)   # H2D on current stream reads it
        work = dist.all_reduce(self.dev, async_op=True)
        work.synchronize()  # only blocks the current *stream*; host returns at once
        self.total.add_(self.dev)
        self.steps += 1

    def result(self):
        return dict(zip(self.names, (self.total / self.steps).tolist()))


def init_single_process_group(port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))


def main():
    init_single_process_group(PORT)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    dev = torch.device("cuda:0")
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 16)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    metrics = StepMetricsAllReducer(["tokens", "samples", "dropped"], dev)

    xs = [torch.randn(128, 512, device=dev) for _ in range(8)]
    ys = [torch.randint(0, 16, (128,), device=dev) for _ in range(8)]
    for step in range(8):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xs[step]), ys[step])
        loss.backward()
        opt.step()
        # host-side bookkeeping produced by the (CPU) data pipeline
        tokens = float(rng.integers(3000, 4000))
        metrics.push([tokens, 128.0, float(rng.integers(0, 5))])

    print("metrics:", metrics.result())
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
