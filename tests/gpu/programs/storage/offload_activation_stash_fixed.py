# Source: pytorch/torchtune torchtune/training/_activation_offloading.py
#   OffloadActivations(saved_tensors_hooks): pack_tensor() copies each saved
#   activation to pinned CPU memory on a comms stream s1 and stashes
#   `self.fwd_stash[tensor_id] = (activation, event)` "to keep activation
#   alive til s1 is done"; old entries are dropped only after
#   `self.s0.wait_event(ev)`.
# Pattern: autograd saved-tensor hooks offload activations (allocated on the
# default stream s0) with non_blocking D2H copies on a side stream s1; the GPU
# activation must stay referenced until s0 has waited for the copy's event,
# otherwise the caching allocator hands its block to the next layer's output.
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
HIDDEN = 1024
BATCH = 2048
LAYERS = 4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.randn(HIDDEN, HIDDEN) / HIDDEN ** 0.5) for _ in range(LAYERS)])

    def forward(self, x):
        for w in self.weights:
            h = x @ w            # mm saves x (and w)
            x = F.gelu(h)        # gelu saves h
        return x


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, params, min_offload_bytes=1 << 20, max_fwd_stash_size=2):
        self.s0 = torch.cuda.current_stream()       # compute stream
        self.s1 = torch.cuda.Stream()               # offload stream
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.min_bytes = min_offload_bytes
        self.max_fwd_stash_size = max_fwd_stash_size
        self.ids = itertools.count()
        self.tracker = {}     # id -> (tensor_or_cpu_copy, d2h_event or None)
        self.fwd_stash = {}   # id -> (gpu activation, d2h_event)
        super().__init__(self.pack_tensor, self.unpack_tensor)

    def _release_stash(self, keep_after):
        for tid in [k for k in self.fwd_stash if k <= keep_after]:
            _, ev = self.fwd_stash[tid]
            self.s0.wait_event(ev)
            del self.fwd_stash[tid]

    def pack_tensor(self, activation):
        tid = next(self.ids)
        nbytes = activation.numel() * activation.element_size()
        if nbytes < self.min_bytes or activation.untyped_storage().data_ptr() in self.param_ptrs:
            self.tracker[tid] = (activation, None)
            return tid
        self._release_stash(tid - self.max_fwd_stash_size)
        self.s1.wait_stream(self.s0)                 # activation has been produced on s0
        with torch.cuda.stream(self.s1):
            torch.cuda._sleep(SLEEP_CYCLES)          # busy copy engine / slow PCIe
            cpu_copy = torch.empty(activation.size(), dtype=activation.dtype, pin_memory=True)
            cpu_copy.copy_(activation, non_blocking=True)
        event = self.s1.record_event()
        # FIX: keep the GPU activation alive until s0 has waited for the D2H event
        self.fwd_stash[tid] = (activation, event)
        self.tracker[tid] = (cpu_copy, event)
        return tid

    def finish_forward(self):
        self._release_stash(float("inf"))

    def unpack_tensor(self, tid):
        obj, event = self.tracker.pop(tid)
        if event is None:
            return obj
        torch.cuda.current_stream().wait_event(event)   # D2H finished before H2D reads
        return obj.to("cuda", non_blocking=True)


def weight_grads(model, x, offloader=None):
    model.zero_grad(set_to_none=True)
    if offloader is None:
        out = model(x)
    else:
        with offloader:
            out = model(x)
        offloader.finish_forward()
    loss = (out * out).mean()
    loss.backward()
    return torch.cat([w.grad.flatten() for w in model.weights])


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    model = MLP().to(dev)
    x = torch.randn(BATCH, HIDDEN, device=dev)

    ref_grads = weight_grads(model, x).clone()
    reference = ref_grads.double().abs().sum().item()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()   # start the offloaded run with no cached free blocks

    offloader = OffloadActivations(model.parameters())
    grads = weight_grads(model, x, offloader)
    checksum = grads.double().abs().sum().item()
    close = torch.allclose(grads, ref_grads, rtol=1e-3, atol=1e-5)
    torch.cuda.synchronize()
    match = bool(close) and abs(checksum - reference) <= 1e-3 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
