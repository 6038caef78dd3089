# Source: accelerate src/accelerate/hooks.py (ModelHook, add_hook_to_module, AlignDevicesHook.pre_forward /
#   post_forward, which onload weights before a block runs and offload them after) and
#   accelerate.utils.operations.send_to_device(non_blocking=True); the stream-prefetching variant follows
#   diffusers' hooks/group_offloading.py (use_stream=True: onload the next group on a side stream, record_stream
#   on the compute stream). User code: a per-block ModelHook that prefetches block i+1 on a transfer stream.
# Bug: the "weights ready" event is recorded after the `with torch.cuda.stream(self.stream):` block, i.e. on
#   the current (compute/default) stream instead of the transfer stream. pre_forward's
#   compute.wait_event(ready) therefore orders nothing: the H2D copies (transfer stream, writing the freshly
#   allocated GPU weights of block i) race with F.linear reading those weights on the default stream.
# Fix: ready.record(self.stream) - the event marks the end of the copies on the transfer stream.
# This file: FIXED version.
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate.hooks import ModelHook, add_hook_to_module
from accelerate.utils import send_to_device

DEVICE = torch.device("cuda", 0)
HIDDEN, N_BLOCKS, BATCH, N_BATCHES = 1024, 6, 64, 3
SLEEP_CYCLES = 30_000_000  # ~15 ms: a PCIe link shared with other transfers


class MLPBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class StreamedOffloader:
    """Keeps every block's weights in pinned host memory and onloads one block ahead on a transfer stream."""

    def __init__(self, blocks, device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.cpu = [{n: p.detach().cpu().pin_memory() for n, p in b.named_parameters()} for b in blocks]
        self.gpu = [None] * len(blocks)
        self.ready = [None] * len(blocks)
        for block, weights in zip(blocks, self.cpu):
            for n, p in block.named_parameters():
                p.data = weights[n]  # park the block in pinned host memory

    def prefetch(self, idx):
        if idx >= len(self.cpu) or self.gpu[idx] is not None:
            return
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            self.gpu[idx] = send_to_device(self.cpu[idx], self.device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(self.stream)  # FIX: mark the end of the copies on the transfer stream
        self.ready[idx] = ready

    def onload(self, idx, module):
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.ready[idx])
        for n, p in module.named_parameters():
            w = self.gpu[idx][n]
            w.record_stream(compute)  # allocated on the transfer stream, used on the compute stream
            p.data = w

    def offload(self, idx, module):
        for n, p in module.named_parameters():
            p.data = self.cpu[idx][n]
        self.gpu[idx] = None
        self.ready[idx] = None


class PrefetchNextBlockHook(ModelHook):
    def __init__(self, offloader, idx):
        self.offloader = offloader
        self.idx = idx

    def pre_forward(self, module, *args, **kwargs):
        if self.idx == 0:
            self.offloader.prefetch(0)  # nobody prefetched the first block of this forward
        self.offloader.onload(self.idx, module)
        self.offloader.prefetch(self.idx + 1)
        device = self.offloader.device
        return send_to_device(args, device), send_to_device(kwargs, device)

    def post_forward(self, module, output):
        self.offloader.offload(self.idx, module)
        return output


def main():
    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(HIDDEN) for _ in range(N_BLOCKS)]).eval()
    reference = copy.deepcopy(model).to(DEVICE)  # fully resident copy, for the check at the end
    inputs = [torch.randn(BATCH, HIDDEN).to(DEVICE) for _ in range(N_BATCHES)]

    offloader = StreamedOffloader(list(model), DEVICE)
    for i, block in enumerate(model):
        add_hook_to_module(block, PrefetchNextBlockHook(offloader, i))
    torch.cuda.synchronize()

    with torch.no_grad():
        outputs = [model(x) for x in inputs]
    torch.cuda.synchronize()

    with torch.no_grad():
        refs = [reference(x) for x in inputs]
    torch.cuda.synchronize()
    worst = max((o - r).abs().max().item() for o, r in zip(outputs, refs))
    ok = all(torch.allclose(o, r, rtol=1e-4, atol=1e-4) for o, r in zip(outputs, refs))
    print(f"max_abs_diff={worst:.3e}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
