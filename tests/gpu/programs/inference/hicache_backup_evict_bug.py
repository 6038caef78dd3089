# Source: sgl-project/sglang python/sglang/srt/managers/cache_controller.py (HiCacheController.write /
#   start_writing: device KV pages are backed up to the pinned host pool on a dedicated write stream
#   and a HiCacheAck(finish_event, node_ids) is appended to ack_write_queue) and
#   python/sglang/srt/mem_cache/hiradix_cache.py (writing_check(): a node only counts as backed up --
#   so that eviction may hand its device pages back to the token_to_kv_pool_allocator -- once its
#   finish_event.query() is True).
# Race (bug): the write stream's D2H copies reading request A's device KV pages vs the default
#   stream's prefill of request B writing the same pages after A was evicted and they were reused.
import time
from collections import namedtuple

import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms of earlier backups already queued on the write stream
PAGE_TOKENS = 64
HEAD_DIM = 128
PAGE_ELEMS = PAGE_TOKENS * HEAD_DIM
NUM_DEVICE_PAGES = 4
NUM_HOST_PAGES = 16
VOCAB = 512

HiCacheAck = namedtuple("HiCacheAck", ["finish_event", "node_id"])


class PageAllocator:
    """Device page free list (the token_to_kv_pool_allocator stand-in)."""

    def __init__(self, num_pages):
        self.free_pages = list(range(num_pages))

    def available(self):
        return len(self.free_pages)

    def alloc(self, n):
        pages = self.free_pages[:n]
        del self.free_pages[:n]
        return pages

    def free(self, pages):
        self.free_pages = sorted(self.free_pages + list(pages))


class CacheController:
    def __init__(self, device_pool, host_pool):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.host_free = list(range(host_pool.shape[0]))
        self.write_stream = torch.cuda.Stream()
        self.ack_write_queue = []

    def write(self, device_pages, node_id):
        host_pages = self.host_free[: len(device_pages)]
        del self.host_free[: len(device_pages)]
        finish_event = torch.cuda.Event()
        self.write_stream.wait_stream(torch.cuda.current_stream())  # KV written by the prefill
        with torch.cuda.stream(self.write_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            for d, h in zip(device_pages, host_pages):
                self.host_pool[h].copy_(self.device_pool[d], non_blocking=True)
            finish_event.record()
        self.ack_write_queue.append(HiCacheAck(finish_event, node_id))
        return host_pages

    def writing_check(self):
        finished = []
        while self.ack_write_queue:
            ack = self.ack_write_queue[0]
            finished.append(ack.node_id)
            self.ack_write_queue.pop(0)
        return finished


class HiRadixCache:
    def __init__(self, allocator, controller):
        self.allocator = allocator
        self.controller = controller
        self.nodes = {}

    def insert(self, node_id, device_pages):
        host_pages = self.controller.write(device_pages, node_id)  # write-through policy
        self.nodes[node_id] = {"device": device_pages, "host": host_pages, "backuped": False}

    def evict(self):
        for node_id in self.controller.writing_check():
            self.nodes[node_id]["backuped"] = True
        for node in self.nodes.values():
            if node["backuped"] and node["device"] is not None:
                self.allocator.free(node["device"])
                node["device"] = None


class ModelRunner:
    def __init__(self, device, device_pool):
        g = torch.Generator().manual_seed(2)
        self.embed_cpu = torch.randint(-4, 4, (VOCAB, HEAD_DIM), generator=g).float()
        self.w_k_cpu = torch.randint(-2, 2, (HEAD_DIM, HEAD_DIM), generator=g).float()
        self.embed = self.embed_cpu.to(device)
        self.w_k = self.w_k_cpu.to(device)
        self.device_pool = device_pool

    def reference_kv(self, tokens_cpu):
        return (self.embed_cpu[tokens_cpu] @ self.w_k_cpu).reshape(-1, PAGE_ELEMS)

    def prefill(self, tokens, pages):
        kv = (self.embed[tokens] @ self.w_k).reshape(len(pages), PAGE_ELEMS)
        for i, p in enumerate(pages):
            self.device_pool[p].copy_(kv[i])


def main():
    device = torch.device("cuda", 0)
    device_pool = torch.zeros(NUM_DEVICE_PAGES, PAGE_ELEMS, device=device)
    host_pool = torch.zeros(NUM_HOST_PAGES, PAGE_ELEMS, pin_memory=True)
    allocator = PageAllocator(NUM_DEVICE_PAGES)
    cache = HiRadixCache(allocator, CacheController(device_pool, host_pool))
    runner = ModelRunner(device, device_pool)
    n_tok = NUM_DEVICE_PAGES * PAGE_TOKENS
    tokens_a_cpu = torch.arange(n_tok) * 7 % VOCAB
    tokens_b_cpu = (torch.arange(n_tok) * 13 + 5) % VOCAB
    tokens_a, tokens_b = tokens_a_cpu.to(device), tokens_b_cpu.to(device)
    torch.cuda.synchronize()
    with torch.inference_mode():
        pages_a = allocator.alloc(NUM_DEVICE_PAGES)
        runner.prefill(tokens_a, pages_a)
        cache.insert("A", pages_a)
        # Request B needs the whole device pool: evict backed-up nodes until it fits.
        while allocator.available() < NUM_DEVICE_PAGES:
            cache.evict()
            if allocator.available() < NUM_DEVICE_PAGES:
                time.sleep(0.0005)
        pages_b = allocator.alloc(NUM_DEVICE_PAGES)
        runner.prefill(tokens_b, pages_b)
        cache.insert("B", pages_b)
    torch.cuda.synchronize()
    backup_a = host_pool[cache.nodes["A"]["host"]]
    ref_a = runner.reference_kv(tokens_a_cpu)
    checksum = float(backup_a.double().sum())
    reference = float(ref_a.double().sum())
    print(f"checksum={checksum:.1f} reference={reference:.1f} match={torch.equal(backup_a, ref_a)}")


if __name__ == "__main__":
    main()
