# Source: pytorch/FBGEMM fbgemm_gpu/fbgemm_gpu/tbe/ssd/inference.py (_prefetch_impl: actions_count_gpu and
#   inserted_indices are copied D2H into pinned buffers on a dedicated ssd_memcpy_stream, the copy is
#   recorded into ssd_event_memcpy, and the host-side ssd_db.get_cuda may only consume the pinned
#   buffers after that event) and pytorch/FBGEMM PR #5480 "Add cache locking and dedicated memcpy
#   stream for SSD TBE inference".
"""SSD-backed embedding cache: the GPU decides which rows miss the HBM cache, the miss list is copied
to pinned host memory, an I/O worker thread reads the rows from the SSD tier (a NumPy array here),
and the rows are copied back into the HBM cache."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

SLEEP_CYCLES = 20_000_000
DEV = torch.device("cuda", 0)
NUM_ROWS, DIM, CACHE_SLOTS, N, BAG, ITERS = 20_000, 64, 16_384, 4096, 8, 3


class SSDCachedEmbedding:
    def __init__(self, ssd_rows):
        self.ssd_rows = ssd_rows  # the SSD tier (RocksDB in FBGEMM)
        self.cache = torch.zeros(CACHE_SLOTS, DIM, device=DEV)
        self.row_to_slot = torch.full((NUM_ROWS,), -1, dtype=torch.int64, device=DEV)
        self.next_slot = 0
        low_priority, _ = torch.cuda.Stream.priority_range()
        self.ssd_memcpy_stream = torch.cuda.Stream(priority=low_priority)
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssd-io")
        self._pinned = []  # pinned buffers are kept until the end of the run

    def _populate_actions(self, indices):
        """Unique missed rows, compacted to the front of a fixed-size list, plus their count (no host sync)."""
        n = indices.numel()
        sorted_idx, _ = torch.sort(indices)
        first = torch.ones(n, dtype=torch.bool, device=DEV)
        first[1:] = sorted_idx[1:] != sorted_idx[:-1]
        miss = first & (self.row_to_slot[sorted_idx] < 0)
        pos = torch.cumsum(miss, 0) - 1
        dest = torch.where(miss, pos, torch.full_like(pos, n))
        inserted = torch.full((n + 1,), -1, dtype=torch.int64, device=DEV)
        inserted.scatter_(0, dest, sorted_idx)
        return inserted[:n], miss.sum()

    def _ssd_get(self, copy_done, actions_count_cpu, inserted_indices_cpu, rows_cpu):
        # I/O worker thread
        count = int(actions_count_cpu.item())
        ids = inserted_indices_cpu[:count].numpy()
        rows_cpu[:count].numpy()[:] = self.ssd_rows[ids]
        return count

    def prefetch(self, indices):
        compute = torch.cuda.current_stream()
        # the populate-actions kernels are queued behind the previous batch's forward
        torch.cuda._sleep(SLEEP_CYCLES)
        inserted, actions_count = self._populate_actions(indices)

        n = indices.numel()
        actions_count_cpu = torch.empty((), dtype=torch.int64, pin_memory=True)
        inserted_indices_cpu = torch.empty(n, dtype=torch.int64, pin_memory=True)
        rows_cpu = torch.empty(n, DIM, dtype=torch.float32, pin_memory=True)
        actions_count_cpu.fill_(0)
        inserted_indices_cpu.fill_(-1)
        self._pinned += [actions_count_cpu, inserted_indices_cpu, rows_cpu]

        copy_done = torch.cuda.Event()
        with torch.cuda.stream(self.ssd_memcpy_stream):
            self.ssd_memcpy_stream.wait_stream(compute)
            actions_count_cpu.copy_(actions_count, non_blocking=True)
            inserted_indices_cpu.copy_(inserted, non_blocking=True)
            copy_done.record(self.ssd_memcpy_stream)
        actions_count.record_stream(self.ssd_memcpy_stream)
        inserted.record_stream(self.ssd_memcpy_stream)

        count = self.io.submit(
            self._ssd_get, copy_done, actions_count_cpu, inserted_indices_cpu, rows_cpu
        ).result()
        if count > 0:
            first, last = self.next_slot, self.next_slot + count
            self.cache[first:last].copy_(rows_cpu[:count], non_blocking=True)
            self.row_to_slot.index_put_((inserted[:count],), torch.arange(first, last, device=DEV))
            self.next_slot = last

    def forward(self, indices):
        slots = self.row_to_slot[indices].clamp_(min=0)
        return self.cache.index_select(0, slots).view(-1, BAG, DIM).sum(1)


def main():
    rng = np.random.default_rng(0)
    ssd_rows = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    host_batches = [rng.integers(0, NUM_ROWS // 2, size=N, dtype=np.int64) for _ in range(ITERS)]
    batches = [torch.from_numpy(b).to(DEV) for b in host_batches]
    emb = SSDCachedEmbedding(ssd_rows)
    torch.cuda.synchronize()

    outputs = []
    for indices in batches:
        emb.prefetch(indices)
        outputs.append(emb.forward(indices))
    got = torch.stack(outputs)
    torch.cuda.synchronize()
    emb.io.shutdown()

    table = torch.from_numpy(ssd_rows)
    ref = torch.stack([table[torch.from_numpy(b)].view(-1, BAG, DIM).sum(1) for b in host_batches])
    got_cpu = got.cpu()
    match = torch.allclose(got_cpu, ref, rtol=1e-5, atol=1e-5)
    checksum, ref_checksum = got_cpu.abs().sum().item(), ref.abs().sum().item()
    torch.cuda.synchronize()
    print(f"checksum={checksum:.4f} reference={ref_checksum:.4f} match={match}")


if __name__ == "__main__":
    main()
