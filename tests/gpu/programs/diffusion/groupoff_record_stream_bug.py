# Source: huggingface/diffusers src/diffusers/hooks/group_offloading.py (ModuleGroup with use_stream=True,
#   record_stream=True: _onload_from_memory / _transfer_tensor_to_device / _offload_to_memory) and
#   huggingface/diffusers PR #12721 (fixes issue #12673, "record_stream in group offloading is not working
#   properly"): record_stream() was passed current_stream() while the code was inside
#   `with torch.cuda.stream(self.stream)`, i.e. the transfer stream itself, so the compute stream's use of the
#   onloaded weights was never recorded.
#
# Block-level group offloading with prefetch. Each block's weights live in pinned CPU memory. The pre-forward
# hook of block i onloads block i+1 on the transfer stream (after synchronizing the previous transfer, as
# diffusers does); the post-forward hook drops block i's GPU weights without synchronizing (record_stream
# mode relies on the caching allocator). The GPU weight is allocated on the transfer stream and read on the
# default (compute) stream.
#   groupoff_record_stream_bug.py:   record_stream(current_stream()) inside the transfer-stream context, i.e.
#                                    the wrong stream; the freed block is reused by a later onload.
#   groupoff_record_stream_fixed.py: the compute stream is captured before entering the context and recorded.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms spin on the compute stream
DIM = 1024
N_BLOCKS = 6
STEPS = 2
DEVICE = torch.device("cuda:0")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)  # slow kernel queued ahead of the weight read
        return torch.tanh(self.proj(x))


class ModuleGroup:
    """One offloaded block: pinned CPU copies of its tensors plus a shared transfer stream."""

    def __init__(self, module, stream):
        self.module = module
        self.stream = stream
        self.cpu_param_dict = {p: p.data.pin_memory() for p in module.parameters()}
        self.next_group = None

    def onload_(self):
        # Wait for the previous host->device transfer before issuing a new one (diffusers does the same).
        self.stream.synchronize()
        with torch.cuda.stream(self.stream):
            for p in self.module.parameters():
                p.data = self.cpu_param_dict[p].to(DEVICE, non_blocking=True)
                p.data.record_stream(torch.cuda.current_stream())

    def offload_(self):
        # record_stream=True: no compute-stream synchronize, the allocator is trusted to defer reuse.
        for p in self.module.parameters():
            p.data = self.cpu_param_dict[p]


def apply_group_offloading(blocks, stream):
    groups = [ModuleGroup(b, stream) for b in blocks]
    for g, nxt in zip(groups, groups[1:]):
        g.next_group = nxt

    for g in groups:
        def pre_forward(module, args, g=g):
            if g.next_group is not None:
                g.next_group.onload_()  # synchronizes this group's own transfer, then prefetches the next
            else:
                g.stream.synchronize()
            return None

        def post_forward(module, args, output, g=g):
            g.offload_()
            return output

        g.module.register_forward_pre_hook(pre_forward)
        g.module.register_forward_hook(post_forward)
    return groups


def main():
    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(N_BLOCKS)])
    x = torch.randn(64, DIM, device=DEVICE)

    with torch.no_grad():
        weights = [b.proj.weight.detach().to(DEVICE) for b in blocks]
        ref = x
        for _ in range(STEPS):
            for w in weights:
                ref = torch.tanh(ref @ w.t())
        torch.cuda.synchronize()
        del weights

        transfer_stream = torch.cuda.Stream()
        groups = apply_group_offloading(blocks, transfer_stream)
        h = x
        for _ in range(STEPS):  # denoising steps
            groups[0].onload_()
            for b in blocks:
                h = b(h)

    torch.cuda.synchronize()
    checksum = h.double().sum().item()
    reference = ref.double().sum().item()
    match = torch.allclose(h, ref, rtol=1e-4, atol=1e-4)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
