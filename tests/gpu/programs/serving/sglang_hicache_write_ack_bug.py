# Structure: SGLang HiCache (python/sglang/srt/managers/cache_controller.py,
# HiCacheController.start_writing: start_event.record(); with
# stream(write_stream): start_event.wait(write_stream); backup_from_device_...;
# finish_event.record()), and HiRadixCache.writing_check(), which polls
# `finish_event.query()` for each ack before the node's host pages are handed
# to the L3 storage backup.  Plausible pattern, not a reported issue: here
# finish_event.record() has slipped out of the write_stream block, so it is
# recorded on the scheduler's (default) stream.  query() returning True then
# says nothing about the D2H copies on write_stream, and the storage backup
# hashes pinned host pages that the DMA may still be writing.
import hashlib
from typing import NamedTuple

import torch

DEV = torch.device("cuda:0")
LAYERS, PAGE, KV_DIM, TOKENS_PER_REQ, NUM_REQS = 4, 16, 1024, 64, 6


class MHATokenToKVPool:  # device pool, one buffer per layer as in SGLang
    def __init__(self, size):
        self.k_buffer = [torch.zeros(size, KV_DIM, device=DEV) for _ in range(LAYERS)]


class MHATokenToKVPoolHost:
    def __init__(self, size):
        self.kv_buffer = torch.zeros(LAYERS, size, KV_DIM, pin_memory=True)
        self.next_free = 0

    def alloc(self, n):
        start, self.next_free = self.next_free, self.next_free + n
        return start

    def backup_from_device_all_layer(self, device_pool, host_start, device_start, n):
        for layer in range(LAYERS):  # io_backend="direct", page-contiguous copies
            self.kv_buffer[layer, host_start:host_start + n].copy_(
                device_pool.k_buffer[layer][device_start:device_start + n], non_blocking=True)

    def get_flat_data_page(self, index):
        return self.kv_buffer[:, index:index + PAGE]


class HiCacheAck(NamedTuple):
    start_event: torch.cuda.Event
    finish_event: torch.cuda.Event
    node_ids: list


class HiCacheController:
    def __init__(self, device_pool, host_pool):
        self.mem_pool_device, self.mem_pool_host = device_pool, host_pool
        self.write_stream = torch.cuda.Stream()
        self.write_queue, self.ack_write_queue = [], []

    def write(self, device_start, n, node_id):
        host_start = self.mem_pool_host.alloc(n)
        self.write_queue.append((host_start, device_start, n, node_id))
        self.start_writing()
        return host_start

    def start_writing(self):
        host_start, device_start, n, node_id = self.write_queue.pop(0)
        start_event, finish_event = torch.cuda.Event(), torch.cuda.Event()
        start_event.record()
        with torch.cuda.stream(self.write_stream):
            start_event.wait(self.write_stream)
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host_start, device_start, n)
        finish_event.record()
        self.ack_write_queue.append(HiCacheAck(start_event, finish_event, [node_id]))


class HiRadixCache:
    def __init__(self, controller):
        self.cache_controller = controller
        self.ongoing_write_through = {}  # node_id -> (host_start, n)
        self.storage = {}                # stands in for the L3 storage backend

    def write_backup(self, node_id, device_start, n):
        host_start = self.cache_controller.write(device_start, n, node_id)
        self.ongoing_write_through[node_id] = (host_start, n)

    def write_backup_storage(self, node_id):
        host_start, n = self.ongoing_write_through.pop(node_id)
        host = self.cache_controller.mem_pool_host
        for p in range(host_start, host_start + n, PAGE):
            page_bytes = host.get_flat_data_page(p).numpy().tobytes()
            self.storage[(node_id, p)] = hashlib.sha256(page_bytes).hexdigest()

    def writing_check(self):
        finish_count = 0
        for ack in self.cache_controller.ack_write_queue:
            if not ack.finish_event.query():
                break
            finish_count += 1
        for _ in range(finish_count):
            ack = self.cache_controller.ack_write_queue.pop(0)
            for node_id in ack.node_ids:
                self.write_backup_storage(node_id)


def prefill(device_pool, weights, x, device_start):
    for layer in range(LAYERS):
        x = torch.tanh(x @ weights[layer])
        device_pool.k_buffer[layer][device_start:device_start + x.shape[0]] = x


def main():
    g = torch.Generator(device=DEV).manual_seed(0)
    weights = [torch.randn(KV_DIM, KV_DIM, device=DEV, generator=g) * 0.05 for _ in range(LAYERS)]
    device_pool = MHATokenToKVPool(NUM_REQS * TOKENS_PER_REQ)
    host_pool = MHATokenToKVPoolHost(NUM_REQS * TOKENS_PER_REQ)
    tree_cache = HiRadixCache(HiCacheController(device_pool, host_pool))
    prompts = torch.randn(NUM_REQS, TOKENS_PER_REQ, KV_DIM, device=DEV, generator=g)
    torch.cuda.synchronize()
    for rid in range(NUM_REQS):  # scheduler loop: prefill, write-through, poll acks
        prefill(device_pool, weights, prompts[rid], rid * TOKENS_PER_REQ)
        tree_cache.write_backup(rid, rid * TOKENS_PER_REQ, TOKENS_PER_REQ)
        tree_cache.writing_check()
    while tree_cache.cache_controller.ack_write_queue:
        tree_cache.writing_check()
    torch.cuda.synchronize()
    print("pages backed up to storage:", len(tree_cache.storage))


if __name__ == "__main__":
    main()
