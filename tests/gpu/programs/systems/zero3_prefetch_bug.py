"""ZeRO-3-style parameter prefetcher, emulated on one GPU: every linear layer
keeps only flat shards of its weight; a forward pre-hook "all-gathers" the
layer (emulated by shard copies on a dedicated all-gather stream) and prefetches
the next layer, and a forward post-hook frees the gathered weight.

Modeled on: deepspeedai/DeepSpeed deepspeed/runtime/zero/partition_parameters.py
`free_param()` ("need to make sure that we don't free the parameter while it is
still being used for computation": param.data.record_stream(current_stream()))
and runtime/zero/partitioned_param_coordinator.py (fetch_sub_module prefetches
on the all-gather stream, release_sub_module frees after forward).

BUG: the post-hook drops the gathered weight without record_stream() on the
compute stream.  The block goes straight back to the all-gather stream's pool
and the very next prefetch (two layers later) is handed the same block and
overwrites it while the compute stream may still be reading it.
"""
from functools import partial

import torch
import torch.nn.functional as F

DEV = torch.device("cuda:0")
WORLD = 4  # emulated data-parallel ranks holding one shard each
N_LAYERS = 6
HID = 1024
BATCH = 256
STEPS = 3


class ShardedLinear(torch.nn.Module):
    def __init__(self, d_in, d_out, gen):
        super().__init__()
        full = torch.randn(d_out * d_in, generator=gen) * d_in ** -0.5
        self.shape = (d_out, d_in)
        self.numel = d_out * d_in
        self.shards = [s.clone().to(DEV) for s in full.chunk(WORLD)]
        self.bias = torch.nn.Parameter(torch.zeros(d_out, device=DEV))
        self.full_weight = None  # materialized only between pre- and post-hook
        self.gathered = None  # event: all-gather finished

    def forward(self, x):
        return F.linear(x, self.full_weight, self.bias)


class Zero3Coordinator:
    def __init__(self, layers):
        self.layers = layers
        self.ag_stream = torch.cuda.Stream(device=DEV)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(partial(self.pre_hook, i))
            layer.register_forward_hook(partial(self.post_hook, i))

    def all_gather(self, layer):
        n = layer.numel // WORLD
        with torch.cuda.stream(self.ag_stream):
            flat = torch.empty(layer.numel, device=DEV)
            for r, shard in enumerate(layer.shards):
                flat.narrow(0, r * n, n).copy_(shard)
            layer.full_weight = flat.view(layer.shape)
            layer.gathered = torch.cuda.Event()
            layer.gathered.record(self.ag_stream)

    def pre_hook(self, idx, module, args):
        if module.full_weight is None:  # not prefetched (first layer)
            self.all_gather(module)
        torch.cuda.current_stream().wait_event(module.gathered)
        if idx + 1 < len(self.layers):
            self.all_gather(self.layers[idx + 1])  # overlap with this layer

    def post_hook(self, idx, module, args, output):
        module.full_weight = None  # release the gathered parameter
        module.gathered = None


def main():
    gen = torch.Generator().manual_seed(0)
    linears = [ShardedLinear(HID, HID, gen) for _ in range(N_LAYERS)]
    body = []
    for lin in linears:
        body += [lin, torch.nn.GELU()]
    model = torch.nn.Sequential(*body)
    Zero3Coordinator(linears)
    xs = [torch.randn(BATCH, HID, generator=gen).to(DEV) for _ in range(STEPS)]
    torch.cuda.synchronize()  # shards and inputs are ready

    total = torch.zeros((), device=DEV)
    with torch.no_grad():
        for x in xs:
            y = model(x)
            total += y.float().pow(2).mean()
    torch.cuda.synchronize()
    print(f"{STEPS} forward passes, checksum {total.item():.5f}")


if __name__ == "__main__":
    main()
