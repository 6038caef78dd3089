# Source: plausible pattern modelled on hierarchical prefix caching: SGLang
# HiCache (python/sglang/srt/managers/cache_controller.py, HiCacheController,
# which loads host-tier KV pages back into the device KV pool on a dedicated
# load_stream) and vLLM v0's CacheEngine.swap_in on the worker's cache stream
# (the worker had to wait on the cache events before running the model).
#
# Race (device-device, read-after-write): prefix-cache hits are loaded from the
# pinned host tier into free blocks of the paged GPU KV pool on
# self.load_stream (staged H2D copies, then kv_pool.index_copy_(0, dst, staged));
# the attention on the default stream gathers the request's blocks with
# kv_pool.index_select(0, block_table) without waiting on the load_done event,
# so it can read stale pages left in those blocks by earlier requests.
# Fix: torch.cuda.current_stream().wait_event(self.load_done) before attention.
import torch

DEV = "cuda:0"
NUM_BLOCKS, BLOCK, KVH, D = 256, 16, 8, 128
HOST_BLOCKS = 1024
REQS, PREFIX_BLOCKS, OWN_BLOCKS, ROUNDS = 8, 8, 8, 8
LOAD_AREA = REQS * PREFIX_BLOCKS  # blocks [0, 2*LOAD_AREA) receive loads
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait: the copy engine is busy


class PagedKVCache:
    def __init__(self):
        shape = (2, BLOCK, KVH, D)  # (k/v, tokens, heads, dim) per block
        self.kv_pool = torch.randn(NUM_BLOCKS, *shape, device=DEV, dtype=torch.float16)
        self.host_pool = torch.randn(HOST_BLOCKS, *shape, dtype=torch.float16).pin_memory()
        self.load_stream = torch.cuda.Stream()
        self.load_done = torch.cuda.Event()

    def load_prefix(self, host_ids, dst):
        """Copy host-tier prefix blocks into the (free) device blocks `dst`."""
        # The destination blocks were used by earlier requests: do not overwrite
        # them before the attention kernels already queued on the default stream.
        self.load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.load_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            staged = torch.empty((len(host_ids), 2, BLOCK, KVH, D), dtype=torch.float16, device=DEV)
            for j, hb in enumerate(host_ids):
                staged[j].copy_(self.host_pool[hb], non_blocking=True)
            self.kv_pool.index_copy_(0, dst, staged)
            self.load_done.record()

    def attention(self, q, block_table):
        """q: [R, KVH, D] fp32, block_table: [R, NB] device block ids."""
        R, NB = block_table.shape
        kv = self.kv_pool.index_select(0, block_table.reshape(-1))
        kv = kv.view(R, NB, 2, BLOCK, KVH, D).float()
        k = kv[:, :, 0].reshape(R, NB * BLOCK, KVH, D)
        v = kv[:, :, 1].reshape(R, NB * BLOCK, KVH, D)
        scores = torch.einsum("rhd,rthd->rht", q, k) / D ** 0.5
        return torch.einsum("rht,rthd->rhd", scores.softmax(dim=-1), v)


@torch.inference_mode()
def main():
    torch.manual_seed(0)
    cache = PagedKVCache()
    g = torch.Generator().manual_seed(1)
    # Scheduler decisions for every round: PREFIX_BLOCKS host-tier hits per
    # request go into the free half of the load area (any order); the
    # request's own blocks are resident. Shipped to the GPU once, up front.
    host_ids, dst_ids, tables = [], [], []
    for rnd in range(ROUNDS):
        dst = torch.randperm(LOAD_AREA, generator=g) + (rnd % 2) * LOAD_AREA
        own = torch.randint(2 * LOAD_AREA, NUM_BLOCKS, (REQS, OWN_BLOCKS), generator=g)
        host_ids.append(torch.randint(0, HOST_BLOCKS, (LOAD_AREA,), generator=g).tolist())
        dst_ids.append(dst)
        tables.append(torch.cat([dst.view(REQS, PREFIX_BLOCKS), own], dim=1))
    dst_ids = torch.stack(dst_ids).to(DEV)
    tables = torch.stack(tables).to(DEV)
    queries = torch.randn(ROUNDS, REQS, KVH, D, device=DEV)
    acc = torch.zeros((), dtype=torch.float64, device=DEV)

    for rnd in range(ROUNDS):
        cache.load_prefix(host_ids[rnd], dst_ids[rnd])
        # BUG: the attention below does not wait for load_done.
        out = cache.attention(queries[rnd], tables[rnd])
        acc += out.double().sum() * (rnd + 1)
    torch.cuda.synchronize()
    print(f"prefix_cache_kv_load checksum: {acc.item():.6f}")


if __name__ == "__main__":
    main()
