# Source: vLLM v0 swap preemption: vllm/worker/worker.py execute_model() issues
# cache_engine.swap_out() on the cache stream (one event per layer) and passes
# cache_events to the model only `if issued_cache_op`; PagedAttention.forward does
# "Wait until the cache op is done. if cache_event is not None: cache_event.wait()"
# right before reshape_and_cache of that layer.  Here the KV cache is one allocation
# viewed per layer (vLLM v1 style), swap_blocks is a per-block copy_ into pinned CPU.
# The bug is a plausible variant of that real code (issued_cache_op not set on the
# swap-out path), not a specific upstream issue.
#
# FIXED version. The bug was: the swap-out branch forgets `issued_cache_op = True`, so the model gets
# cache_events=None and layer i writes the new request's KV (index_copy_ via the
# slot mapping) into the blocks the cache stream is still reading for swap-out.
import torch

DEV = torch.device("cuda:0")
LAYERS, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 4, 32, 32
BLOCK, HEADS, DIM = 16, 8, 64


class CacheEngine:
    def __init__(self):
        self.gpu_cache = torch.zeros(LAYERS, NUM_GPU_BLOCKS, BLOCK, 2, HEADS, DIM,
                                     device=DEV, dtype=torch.float16)
        self.cpu_cache = torch.zeros(LAYERS, NUM_CPU_BLOCKS, BLOCK, 2, HEADS, DIM,
                                     dtype=torch.float16, pin_memory=True)
        self.cache_stream = torch.cuda.Stream()
        self.events = [torch.cuda.Event() for _ in range(LAYERS)]

    def swap_out(self, src_to_dst):
        with torch.cuda.stream(self.cache_stream):
            for i in range(LAYERS):
                for g, c in src_to_dst.items():
                    self.cpu_cache[i, c].copy_(self.gpu_cache[i, g], non_blocking=True)
                self.events[i].record(stream=self.cache_stream)


class Attention:
    def __init__(self, layer, cache):
        self.kv = cache.gpu_cache[layer]               # this layer's view
        self.kv_slots = self.kv.view(-1, 2, HEADS, DIM)

    def forward(self, new_kv, slot_mapping, block_table, cache_event):
        if cache_event is not None:
            cache_event.wait()  # wait until the cache op is done
        self.kv_slots.index_copy_(0, slot_mapping, new_kv)  # reshape_and_cache
        kv = self.kv.index_select(0, block_table)
        return kv[:, :, 0].float().mean(dim=(0, 1))


class Worker:
    def __init__(self):
        self.cache_engine = CacheEngine()
        self.layers = [Attention(i, self.cache_engine) for i in range(LAYERS)]
        self.cache_events = self.cache_engine.events

    def execute_model(self, block_table, num_tokens, blocks_to_swap_out):
        issued_cache_op = False
        if blocks_to_swap_out:
            self.cache_engine.swap_out(blocks_to_swap_out)
            issued_cache_op = True  # FIX: layers must wait for the swap-out events
        cache_events = self.cache_events if issued_cache_op else None

        slots = torch.tensor([block_table[t // BLOCK] * BLOCK + t % BLOCK
                              for t in range(num_tokens)], pin_memory=True)
        slot_mapping = slots.to(DEV, non_blocking=True)
        table = torch.tensor(block_table, pin_memory=True).to(DEV, non_blocking=True)
        h = torch.zeros(HEADS, DIM, device=DEV)
        for i, layer in enumerate(self.layers):
            new_kv = torch.randn(num_tokens, 2, HEADS, DIM, device=DEV, dtype=torch.float16)
            ev = cache_events[i] if cache_events is not None else None
            h = h + layer.forward(new_kv, slot_mapping, table, ev)
        return h.argmax(-1).tolist()  # sampler output read back on the host


def main():
    torch.manual_seed(0)
    worker = Worker()
    free = list(range(NUM_GPU_BLOCKS))
    torch.cuda.synchronize()  # setup done before any side-stream work

    # step 0: request A (running) prefills into 6 blocks
    a_blocks, free = free[:6], free[6:]
    worker.execute_model(a_blocks, 6 * BLOCK, {})
    for step in range(1, 4):
        # memory pressure: preempt the running request by swapping it out and give
        # its freed GPU blocks (most recently freed first) to the newcomer's prefill
        swap_map = {g: (step - 1) * 6 + j for j, g in enumerate(a_blocks)}
        free = a_blocks + free
        a_blocks, free = free[:6], free[6:]
        out = worker.execute_model(a_blocks, 6 * BLOCK - step, swap_map)
    torch.cuda.synchronize()
    print("sampled", out, "cpu checksum",
          float(worker.cache_engine.cpu_cache.float().abs().sum()))


if __name__ == "__main__":
    main()
