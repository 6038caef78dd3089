# Source: dvmazur/mixtral-offloading src/expert_cache.py (ExpertCache keeps a few experts resident on
#   the GPU, offloaded ones in pinned storages; load_experts() is a generator that yields
#   (uid, expert) while the next experts are swapped in with non_blocking copies and the least
#   recently used resident expert is evicted). Here the swap-in copies run on a dedicated H2D stream
#   and each swapped-in weight is a fresh tensor allocated on that stream, dropped on eviction.
# Bug (expert_cache_evict_bug.py): the weight is allocated on the copy stream but consumed by the
#   expert GEMM on the default stream, and nothing tells the caching allocator; once the expert is
#   evicted and the caller's loop variable moves on, its block goes back to the copy stream's pool
#   and the H2D copy of a later expert overwrites it while the (delayed) GEMM still reads it.
# Fix (expert_cache_evict_fixed.py): w.record_stream(current stream) before handing the weight out.
from collections import OrderedDict

import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms on the default stream before each expert GEMM (slow expert compute)
H, FFN, E, T, CAPACITY = 256, 1536, 6, 512, 1  # 1.5 MB weights: large-pool blocks
DEV = torch.device("cuda:0")


class ExpertCache:
    def __init__(self, cpu_experts, capacity):
        self.cpu_experts = cpu_experts            # uid -> pinned [H, FFN] weight
        self.capacity = capacity
        self.resident = OrderedDict()             # uid -> GPU weight, LRU order
        self.copy_stream = torch.cuda.Stream()
        self.hits = self.misses = 0

    def _swap_in(self, uid):
        src = self.cpu_experts[uid]
        with torch.cuda.stream(self.copy_stream):
            w = torch.empty(src.shape, dtype=src.dtype, device=DEV)  # allocated on copy_stream
            w.copy_(src, non_blocking=True)
        ready = self.copy_stream.record_event()
        return w, ready

    def load_experts(self, *uids):
        """Generator: yields (uid, weight) with the weight ready to use on the current stream."""
        for uid in uids:
            ready = None
            if uid in self.resident:
                self.resident.move_to_end(uid)
                self.hits += 1
            else:
                self.misses += 1
                if len(self.resident) >= self.capacity:
                    self.resident.popitem(last=False)   # evict LRU expert (drops the cache's ref)
                self.resident[uid], ready = self._swap_in(uid)
            w = self.resident[uid]
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            yield uid, w


@torch.no_grad()
def main():
    torch.manual_seed(0)
    cpu_experts = {uid: torch.randn(H, FFN).mul_(H ** -0.5).pin_memory() for uid in range(E)}
    x = torch.randn(T, H, device=DEV)
    gates = torch.softmax(torch.randn(T, E, device=DEV), dim=-1)
    torch.cuda.synchronize()

    ref = torch.zeros(T, FFN, device=DEV)
    for uid in range(E):
        ref += F.silu(x @ cpu_experts[uid].to(DEV)) * gates[:, uid:uid + 1]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # start the cached run with no cached free blocks

    cache = ExpertCache(cpu_experts, CAPACITY)
    out = torch.zeros(T, FFN, device=DEV)
    for uid, w in cache.load_experts(*range(E)):
        torch.cuda._sleep(SLEEP_CYCLES)
        out += F.silu(x @ w) * gates[:, uid:uid + 1]
    torch.cuda.synchronize()

    checksum = out.double().abs().sum().item()
    reference = ref.double().abs().sum().item()
    match = torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match} misses={cache.misses}")


if __name__ == "__main__":
    main()
