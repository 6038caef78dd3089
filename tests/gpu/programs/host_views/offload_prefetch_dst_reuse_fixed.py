# Source: huggingface/diffusers src/diffusers/hooks/group_offloading.py (ModuleGroup onload with use_stream=True:
#   pinned CPU weights copied to the GPU on a transfer stream, the next group prefetched while the current one
#   computes), in the form of the ROCm/pytorch#3194 reproducer discussed on diffusers PR #13502: the destination is
#   allocated on the default stream (torch.empty(cpu_w.shape, device=...)) and filled with copy_(non_blocking=True)
#   under `with torch.cuda.stream(transfer_stream)`; the consumer does default.wait_stream(transfer_stream).
#   The pinned weights come from numpy shards (torch.from_numpy(shard).pin_memory()).
# Bug: the pre-copy edge transfer_stream.wait_stream(default_stream) is missing (the edge jeffdaily pointed out in
#   ROCm/pytorch#3194). Block i+1's destination, prefetched while block i runs, is allocated on the default stream
#   after block i-2's weight was dropped, so the caching allocator legally hands it block i-2's memory (same
#   stream, same size). The H2D copy on the transfer stream then overwrites it while block i-2's matmul, queued on the lagging
#   default stream, has not read it yet: transfer-stream write of the new allocation vs default-stream read of the
#   previous allocation in the same device block (a reuse race, not a missing record_stream: the block's owner is
#   the default stream).
# Fix: transfer_stream.wait_stream(torch.cuda.current_stream()) before the copy in _onload(), so the copy into the
#   recycled block is ordered after everything the default stream had queued on it.
import numpy as np
import torch

HIDDEN, NUM_BLOCKS, TOKENS = 1024, 8, 64


class StreamedBlockStack:
    def __init__(self, numpy_shards, device):
        self.cpu_weights = [torch.from_numpy(shard).pin_memory() for shard in numpy_shards]
        self.device = device
        self.transfer_stream = torch.cuda.Stream()

    def _onload(self, i):
        cpu_w = self.cpu_weights[i]
        w_gpu = torch.empty(cpu_w.shape, dtype=cpu_w.dtype, device=self.device)
        self.transfer_stream.wait_stream(torch.cuda.current_stream())  # w_gpu's block may be recycled
        with torch.cuda.stream(self.transfer_stream):
            w_gpu.copy_(cpu_w, non_blocking=True)
        return w_gpu

    @torch.no_grad()
    def forward(self, h):
        default_stream = torch.cuda.current_stream()
        w, next_w = None, self._onload(0)
        for i in range(NUM_BLOCKS):
            default_stream.wait_stream(self.transfer_stream)  # consumer edge: block i's weight has landed
            w, next_w = next_w, (self._onload(i + 1) if i + 1 < NUM_BLOCKS else None)  # prefetch block i+1
            torch.cuda._sleep(20_000_000)  # attention/norms of block i keep the default stream busy
            h = torch.relu(h @ w)
        return h


def main():
    device = torch.device("cuda:0")
    rng = np.random.default_rng(0)
    shards = [(rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN / 2)).astype(np.float32) for _ in range(NUM_BLOCKS)]
    stack = StreamedBlockStack(shards, device)
    x = torch.from_numpy(rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)).to(device)
    torch.relu(x @ x.T).sum().item()  # warm up cuBLAS before the pipelined pass

    outs = [stack.forward(x) for _ in range(2)]  # two denoising steps

    torch.cuda.synchronize()
    ref = x
    with torch.no_grad():
        for shard in shards:
            ref = torch.relu(ref @ torch.from_numpy(shard).to(device))
    match = all(torch.allclose(o, ref, atol=1e-5, rtol=1e-4) for o in outs)
    print("out norm %.4f ref norm %.4f" % (outs[-1].norm().item(), ref.norm().item()))
    print("match=%s" % match)


if __name__ == "__main__":
    main()
