"""ddp_hook_unsynced_future -- FIXED version.

Plausible pattern (no single upstream issue) built from two real torch files:
torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py::_allreduce_fut returns
    dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])
whose CUDA-aware future makes DDP's Reducer wait on the NCCL stream, while
debugging_hooks.py::noop_hook returns a plain `torch.futures.Future()` with
`set_result(bucket.buffer())`.  A custom hook that mixes the two (launch the async
all-reduce, then hand DDP an already-completed CPU future) loses the ordering:
Reducer::finalize_backward calls future.wait() (no stream wait for a CPU future) and
copies the bucket into param.grad on the default stream while NCCL may still write it.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

PORT = 29704  # (its bug version uses 29604: the two may run at once)


def allreduce_mean_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    buf.div_(group.size())
    # FIX (as default_hooks._allreduce_fut): return the Work's CUDA-aware future, so the
    # Reducer's wait() makes the current stream wait for the NCCL stream.
    return (dist.all_reduce(buf, group=group, async_op=True)
            .get_future().then(lambda f: f.value()[0]))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 512), nn.ReLU(),
                                  nn.Linear(512, 512), nn.ReLU())
        self.head = nn.Linear(512, 10)

    def forward(self, x):
        return self.head(self.body(x))


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
    model = DDP(Net().to(dev), device_ids=[0])
    model.register_comm_hook(state=None, hook=allreduce_mean_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    xs = [torch.randn(64, 256, device=dev) for _ in range(5)]
    ys = [torch.randint(0, 10, (64,), device=dev) for _ in range(5)]
    losses = []
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xs[step]), ys[step])
        loss.backward()    # hook launches NCCL; Reducer copies bucket -> .grad at the end
        opt.step()
        losses.append(loss.detach())

    torch.cuda.synchronize()
    print("losses:", [round(v, 4) for v in torch.stack(losses).tolist()])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
