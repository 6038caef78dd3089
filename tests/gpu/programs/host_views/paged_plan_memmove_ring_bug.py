# Source: flashinfer/decode.py, BatchDecodeWithPagedKVCacheWrapper.plan()/run(): the planner writes kv_indptr /
#   kv_indices / kv_last_page_len into the page-locked _pin_memory_int_workspace_buffer through a raw pointer (the
#   C++ plan function) and copies it to _int_workspace_buffer with an async H2D on the current stream; run() reads
#   the device copy. Here, as an engine with an overlap scheduler does, plan() for the next batch runs while the
#   GPU still works on earlier ones, so the page-locked staging area is double-buffered (two slots, a ring), and
#   the host fills a slot with ctypes.memmove into slot.data_ptr().
# Bug: the ring has no per-slot completion tracking. When the GPU is more than one step behind the host, plan()
#   for step k+2 memmoves into the slot that the non_blocking H2D copy of step k (queued on the default stream
#   behind earlier forwards) has not read yet: host write (ctypes.memmove into pinned memory) vs default-stream
#   read of the same pinned slot, no happens-before edge. Step k decodes with step k+2's page table.
# Fix: record a CUDA event after each slot's H2D copy and, before the host rewrites that slot, poll it
#   (while not event.query(): time.sleep(0)) so the host never blocks in cudaEventSynchronize.
import ctypes
import time

import numpy as np
import torch

NUM_PAGES, PAGE_SIZE, HEAD_DIM, BATCH, STEPS = 256, 16, 64, 8, 10
BASE_PAGES = np.array([1, 2, 3, 4, 5, 6, 7, 4], dtype=np.int32)  # nnz stays 32 at every step


def paged_decode(q, kv_cache, indptr, indices, last_page_len, nnz):
    indptr, indices, last_page_len = indptr.long(), indices.long().clamp(0, NUM_PAGES - 1), last_page_len.long()
    pos = torch.arange(nnz, device=q.device)
    req_ids = torch.searchsorted(indptr[1:], pos, right=True).clamp(max=BATCH - 1)
    is_last = pos == (indptr[1:][req_ids] - 1)
    valid_rows = torch.where(is_last, last_page_len[req_ids], torch.full_like(req_ids, PAGE_SIZE))
    row_mask = torch.arange(PAGE_SIZE, device=q.device)[None, :] < valid_rows[:, None]
    page_sum = (kv_cache[indices] * row_mask[..., None]).sum(1)
    per_req = torch.zeros(BATCH, HEAD_DIM, device=q.device).index_add_(0, req_ids, page_sum)
    return per_req * q


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, device, int_workspace_bytes=8192, num_slots=2):
        self._int_workspace_buffer = torch.empty(int_workspace_bytes, dtype=torch.uint8, device=device)
        self._pin_memory_int_workspace_buffer = torch.empty((num_slots, int_workspace_bytes), dtype=torch.uint8, pin_memory=True)
        self._num_slots, self._slot = num_slots, 0
        self._slot_events = [None] * num_slots

    def plan(self, kv_indptr, kv_indices, kv_last_page_len):
        slot = self._slot
        self._slot = (slot + 1) % self._num_slots
        staging = self._pin_memory_int_workspace_buffer[slot]
        base, offset, self._offsets = staging.data_ptr(), 0, {}
        for name, arr in (("indptr", kv_indptr), ("indices", kv_indices), ("last_page_len", kv_last_page_len)):
            arr = np.ascontiguousarray(arr, dtype=np.int32)
            ctypes.memmove(base + offset, arr.ctypes.data, arr.nbytes)  # what the C++ planner does
            self._offsets[name] = (offset, arr.size)
            offset += (arr.nbytes + 63) // 64 * 64
        self._int_workspace_buffer[:offset].copy_(staging[:offset], non_blocking=True)
        self._nnz = int(kv_indices.size)

    def _view(self, name):
        off, n = self._offsets[name]
        return self._int_workspace_buffer[off:off + 4 * n].view(torch.int32)

    def run(self, q, kv_cache):
        return paged_decode(q, kv_cache, self._view("indptr"), self._view("indices"), self._view("last_page_len"), self._nnz)


def make_batch(rng):
    counts = rng.permutation(BASE_PAGES)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    indices = rng.choice(NUM_PAGES, size=int(indptr[-1]), replace=False).astype(np.int32)
    last_page_len = rng.integers(1, PAGE_SIZE + 1, size=BATCH).astype(np.int32)
    return indptr, indices, last_page_len


def main():
    device = torch.device("cuda:0")
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    kv_cache = torch.randint(0, 4, (NUM_PAGES, PAGE_SIZE, HEAD_DIM), device=device).float()
    wrapper = BatchDecodeWithPagedKVCacheWrapper(device)
    outs, plans, queries = [], [], []
    for step in range(STEPS):
        plan = make_batch(rng)
        wrapper.plan(*plan)
        q = torch.randint(1, 3, (BATCH, HEAD_DIM), device=device).float()
        torch.cuda._sleep(20_000_000)  # the rest of the decoder layers of this step
        outs.append(wrapper.run(q, kv_cache))
        plans.append(plan)
        queries.append(q)

    torch.cuda.synchronize()
    match = True
    for out, (indptr, indices, last), q in zip(outs, plans, queries):
        ref = paged_decode(q, kv_cache, torch.from_numpy(indptr).to(device), torch.from_numpy(indices).to(device),
                           torch.from_numpy(last).to(device), int(indices.size))
        match &= bool(torch.equal(out, ref))
    print("steps=%d checksum=%.1f" % (STEPS, sum(o.sum().item() for o in outs)))
    print("match=%s" % match)


if __name__ == "__main__":
    main()
