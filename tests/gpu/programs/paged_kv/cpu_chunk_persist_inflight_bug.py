# Source: LMCache/LMCache issue #2286 ("Breaking the CacheEngine store function down
# into get/put"): LMCacheEngine.store() runs gpu_connector.batched_from_gpu (a
# non_blocking GPU->CPU copy on a store stream into pinned memory objects) and then
# storage_manager.batched_put(); a non-CPU backend (local disk) may persist the memory
# objects before the copy has landed ("the memory_objs have not being filled fully").
# Plain torch: LocalCPUBackend = rows of one pinned tensor, the "disk" write reads the
# row on the host (clone()), KV chunks are contiguous token ranges of the paged cache.
#
# BUG: batched_put persists every memory object immediately, including the one whose
# D2H copy was just enqueued on the store stream: the host reads pinned rows the DMA
# is still writing.
from collections import deque

import torch

DEV = torch.device("cuda:0")
NUM_TOKENS, CHUNK, NUM_CPU_CHUNKS = 4096, 256, 16
HEADS, DIM = 8, 64


class LocalCPUBackend:
    def __init__(self):
        self.pool = torch.zeros(NUM_CPU_CHUNKS, CHUNK, 2, HEADS, DIM,
                                dtype=torch.float16, pin_memory=True)
        self.next_row = 0

    def allocate(self):
        row = self.next_row
        self.next_row = (self.next_row + 1) % NUM_CPU_CHUNKS
        return row


class LocalDiskBackend:
    def __init__(self):
        self.files = {}

    def put(self, key, memory_obj):
        self.files[key] = memory_obj.clone()  # host read of the pinned chunk


class StoreJob:
    def __init__(self, key, row, event):
        self.key, self.row, self.event = key, row, event


class StorageManager:
    def __init__(self, cpu, disk):
        self.cpu, self.disk = cpu, disk
        self.pending = deque()

    def batched_put(self, jobs):
        self.pending.extend(jobs)
        while self.pending:
            job = self.pending.popleft()
            self.disk.put(job.key, self.cpu.pool[job.row])

    def drain(self):
        while self.pending:
            job = self.pending.popleft()
            job.event.synchronize()
            self.disk.put(job.key, self.cpu.pool[job.row])


class CacheEngine:
    def __init__(self):
        self.kv = torch.zeros(NUM_TOKENS, 2, HEADS, DIM, device=DEV, dtype=torch.float16)
        self.cpu = LocalCPUBackend()
        self.storage = StorageManager(self.cpu, LocalDiskBackend())
        self.store_stream = torch.cuda.Stream()

    def prefill(self, start, end):  # compute stream writes the chunk's KV
        self.kv[start:end].normal_()

    def store(self, key, start, end):
        self.store_stream.wait_stream(torch.cuda.current_stream())
        row = self.cpu.allocate()
        with torch.cuda.stream(self.store_stream):  # batched_from_gpu
            self.cpu.pool[row].copy_(self.kv[start:end], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.storage.batched_put([StoreJob(key, row, event)])


def main():
    torch.manual_seed(0)
    engine = CacheEngine()
    torch.cuda.synchronize()  # setup done before any side-stream work
    for i in range(8):
        start, end = i * CHUNK, (i + 1) * CHUNK
        engine.prefill(start, end)
        engine.store(f"chunk-{i}", start, end)
    engine.storage.drain()
    torch.cuda.synchronize()
    files = engine.storage.disk.files
    print("persisted", len(files), "checksum",
          float(sum(t.float().abs().sum() for t in files.values())))


if __name__ == "__main__":
    main()
