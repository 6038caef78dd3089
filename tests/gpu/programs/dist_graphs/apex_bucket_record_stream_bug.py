"""apex_bucket_record_stream -- BUG version.

Source: NVIDIA/apex, apex/parallel/distributed.py, DistributedDataParallel.allreduce_bucket
(overlapping path, one side stream per bucket).  apex flattens each ready bucket on the
main stream, then runs predivide / dist.all_reduce / unflatten-copy on a bucket stream
under `with torch.cuda.stream(bucket_stream)` and ends with
    # ... tensor will eventually go out of scope and die, at which point it could otherwise
    # be freed for further reuse by the main stream while the allreduce/div/unflatten are
    # underway in bucket_stream.
    tensor.record_stream(bucket_stream)
This version omits that record_stream (the flat bucket is dropped when allreduce_bucket
returns and the main stream reallocates it for the next bucket).
Buckets are launched from post-accumulate-grad hooks during backward, as in apex.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

PORT = 29603


class OverlappingBucketDDP:
    def __init__(self, module, num_allreduce_streams=2):
        self.module = module
        self.world_size = dist.get_world_size()
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        # one bucket per layer, in the order gradients become ready (reverse)
        self.buckets = [[m.weight, m.bias] for m in reversed(linears)]
        self.param_to_bucket = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.ready = [0] * len(self.buckets)
        self.bucket_streams = [torch.cuda.Stream() for _ in range(num_allreduce_streams)]
        self.bucket_events = [torch.cuda.Event() for _ in range(num_allreduce_streams)]
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def __call__(self, x):
        return self.module(x)

    def _grad_ready(self, param):
        i = self.param_to_bucket[id(param)]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            self.ready[i] = 0
            self.allreduce_bucket([p.grad for p in self.buckets[i]], i)

    def allreduce_bucket(self, bucket, bucket_idx):
        tensor = _flatten_dense_tensors(bucket)   # allocated on the main stream
        k = bucket_idx % len(self.bucket_streams)
        bucket_stream, bucket_event = self.bucket_streams[k], self.bucket_events[k]
        torch.cuda.current_stream().record_event(bucket_event)
        bucket_stream.wait_event(bucket_event)
        with torch.cuda.stream(bucket_stream):
            tensor.mul_(1.0 / self.world_size)
            dist.all_reduce(tensor)
            for buf, synced in zip(bucket, _unflatten_dense_tensors(tensor, bucket)):
                buf.copy_(synced)
        return tensor

    def finish_backward(self):
        main = torch.cuda.current_stream()
        for s in self.bucket_streams:
            main.wait_stream(s)


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
    layers = []
    for _ in range(4):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(512, 512)).to(dev)
    ddp = OverlappingBucketDDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    xs = [torch.randn(64, 512, device=dev) for _ in range(5)]
    ys = [torch.randn(64, 512, device=dev) for _ in range(5)]
    losses = []
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(xs[step]), ys[step])
        loss.backward()          # buckets are all-reduced on bucket streams from hooks
        ddp.finish_backward()
        opt.step()
        losses.append(loss.detach())

    torch.cuda.synchronize()
    print("losses:", [round(v, 5) for v in torch.stack(losses).tolist()])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
