"""zero3_param_swap (bug version).

Source: microsoft/DeepSpeed deepspeed/runtime/zero/partition_parameters.py::free_param():

    if get_accelerator().on_accelerator(param.data):
        # need to make sure that we don't free the parameter while it is still
        # being used for computation
        if not get_accelerator().is_synchronized_device():
            param.data.record_stream(get_accelerator().current_stream())
    # param.data doesn't store anything meaningful in partitioned state
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)

ZeRO-3 all-gathers a module's partitions on a dedicated allgather stream into one flat buffer
(PartitionedParameterCoordinator / _all_gather_coalesced) and points each param.data at a
narrow() view of it.  This script is that flow with the record_stream line missing.  The
"all-gather" is simulated by copying the WORLD shards that one process holds.
"""
import math

import torch

DEV = torch.device("cuda", 0)
WORLD, D, BATCH, LAYERS, STEPS = 4, 1024, 2048, 4, 2


def free_param(p):
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)


class ZeroLinear:
    """A Linear layer whose weight and bias are partitioned flat across WORLD ranks."""

    def __init__(self):
        flat = torch.cat([torch.randn(D * D, device=DEV).div_(D ** 0.5), torch.zeros(D, device=DEV)])
        self.shards = [s.clone() for s in flat.chunk(WORLD)]
        self.numel = flat.numel()
        self.weight = torch.nn.Parameter(torch.empty(0, device=DEV), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(0, device=DEV), requires_grad=False)
        self.params = [(self.weight, (D, D)), (self.bias, (D,))]


class ParamCoordinator:
    def __init__(self):
        self.ag_stream = torch.cuda.Stream(DEV)

    def fetch(self, mod):
        with torch.cuda.stream(self.ag_stream):
            flat = torch.empty(mod.numel, device=DEV)          # allocated on the allgather stream
            for dst, src in zip(flat.chunk(WORLD), mod.shards):
                dst.copy_(src)                                 # "all-gather" writes the buffer
        off = 0
        for p, shape in mod.params:
            n = math.prod(shape)
            p.data = flat.narrow(0, off, n).view(shape)        # params become views of flat
            off += n
        torch.cuda.current_stream(DEV).wait_stream(self.ag_stream)

    def release(self, mod):
        for p, _ in mod.params:
            free_param(p)       # flat is freed when the last view (bias) is dropped


@torch.no_grad()
def forward(mods, coord, x):
    # partitions were last written on the compute stream (optimizer / init)
    coord.ag_stream.wait_stream(torch.cuda.current_stream(DEV))
    for mod in mods:
        coord.fetch(mod)
        x = torch.relu(torch.nn.functional.linear(x, mod.weight, mod.bias))   # compute stream
        coord.release(mod)
    return x


def main():
    torch.manual_seed(0)
    mods = [ZeroLinear() for _ in range(LAYERS)]
    coord = ParamCoordinator()
    inputs = [torch.randn(BATCH, D, device=DEV) for _ in range(STEPS)]
    outs = [forward(mods, coord, x).sum() for x in inputs]
    torch.cuda.synchronize()
    print("out", [round(o.item(), 3) for o in outs])


if __name__ == "__main__":
    main()
