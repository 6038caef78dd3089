# Source: diffusers src/diffusers/hooks/group_offloading.py, ModuleGroup.onload_() / _offload_to_memory() and
#         GroupOffloadingHook.pre_forward (enable_group_offload(..., use_stream=True, record_stream=False)),
#         with the offloaded transformer blocks run through torch.compile. onload_() copies the group's pinned
#         CPU weights to the GPU on the transfer stream (the copies are allocated on that stream) and prefetches
#         the next group; _offload_to_memory() just rebinds param.data to the pinned CPU copy, which frees the
#         GPU tensors. With record_stream=False diffusers calls current_stream().synchronize() first.
# Bug: _offload_to_memory() drops the onloaded GPU weights right after the compiled block was *enqueued* on the
#      default stream, with neither record_stream(default) nor the synchronize. The blocks belong to the transfer
#      stream, so the caching allocator hands them to the next prefetch (group i+2) on that stream at once and
#      its H2D copy overwrites them while the default stream's compiled block i has not read them yet: default
#      stream read vs transfer stream write of the freed-and-reused weight block (missing record_stream).
# Fix: _offload_to_memory() does torch.cuda.current_stream().synchronize() before releasing the weights (the
#      record_stream=False path of diffusers), so the host (and every later transfer-stream allocation) is
#      ordered after the compute that read them.
import torch

DEVICE = torch.device("cuda:0")
SLEEP_CYCLES = 30_000_000  # ~15 ms on an H200
DIM, FFN, TOKENS, NUM_BLOCKS = 512, 1024, 256, 6


@torch.compile
def transformer_block(hidden_states, w_in, w_out):
    h = torch.nn.functional.gelu(hidden_states @ w_in)
    return hidden_states + h @ w_out


class ModuleGroup:
    def __init__(self, cpu_weights, stream):
        self.cpu_param_dict = cpu_weights  # pinned CPU copies, never modified
        self.stream = stream
        self.weights = None

    def onload_(self):
        if self.stream is not None:
            self.stream.synchronize()  # wait for the previous host->device transfer to complete
        with torch.cuda.stream(self.stream):
            self.weights = [w.to(DEVICE, non_blocking=True) for w in self.cpu_param_dict]

    def offload_(self):
        # FIX: record_stream=False path: wait until the compute stream is done with the weights
        torch.cuda.current_stream().synchronize()
        self.weights = None


class GroupOffloadedTransformer:
    def __init__(self, cpu_blocks):
        self.transfer_stream = torch.cuda.Stream()
        self.groups = [ModuleGroup(ws, self.transfer_stream) for ws in cpu_blocks]

    def forward(self, hidden_states):
        for i, group in enumerate(self.groups):
            # GroupOffloadingHook.pre_forward: onload this group, wait for it, prefetch the next one
            if i == 0:
                group.onload_()
            torch.cuda.current_stream().wait_stream(self.transfer_stream)
            if i + 1 < len(self.groups):
                self.groups[i + 1].onload_()
            torch.cuda._sleep(SLEEP_CYCLES)  # stand-in for the attention of a real DiT block
            hidden_states = transformer_block(hidden_states, *group.weights)
            group.offload_()  # GroupOffloadingHook.post_forward
        return hidden_states


@torch.no_grad()
def main():
    torch.manual_seed(0)
    cpu_blocks = [[(torch.randn(DIM, FFN) * 0.03).pin_memory(), (torch.randn(FFN, DIM) * 0.03).pin_memory()]
                  for _ in range(NUM_BLOCKS)]
    x = torch.randn(TOKENS, DIM, device=DEVICE)

    # compile once outside the timed pass (resident weights, blocking copies)
    transformer_block(x, cpu_blocks[0][0].to(DEVICE), cpu_blocks[0][1].to(DEVICE))
    torch.cuda.synchronize()

    model = GroupOffloadedTransformer(cpu_blocks)
    out = model.forward(x)
    torch.cuda.synchronize()

    ref = x
    for w_in, w_out in cpu_blocks:
        ref = transformer_block(ref, w_in.to(DEVICE), w_out.to(DEVICE))
    torch.cuda.synchronize()
    print(f"max_abs_diff={(out - ref).abs().max().item():.3e} match={torch.allclose(out, ref, atol=1e-4, rtol=1e-4)}")


if __name__ == "__main__":
    main()
