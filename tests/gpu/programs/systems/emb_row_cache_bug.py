"""Embedding table with a software row cache on the GPU (torchrec / FBGEMM TBE
"UVM caching" style): the full table lives in pinned host memory, CACHE_SLOTS
rows are cached on the GPU, and the rows of batch i+1 are prefetched into the
cache on a prefetch stream while the forward of batch i runs on the main stream.

Modeled on: pytorch/FBGEMM issue #1201 ("Latter prefetch may evict previous
prefetched embeddings": prefetch_2 may evict rows still used by compute_1),
FBGEMM PR #1893 (prefetch pipeline: cache-line locking plus stream ordering)
and meta-pytorch/torchrec PR #4191 (UVM cache cross-stream race in
PrefetchTrainPipelineSparseDist).  Self-contained re-creation.

BUG: eviction skips the rows of the batch about to run ("locked" on the host),
but the prefetch stream never waits for the forwards already enqueued on the
main stream, so the slots it evicts and overwrites (last read by forward(i-1)
or earlier) may still be being read.
"""
from collections import OrderedDict

import torch

DEV = torch.device("cuda:0")
NUM_ROWS = 4096
DIM = 128
CACHE_SLOTS = 384
SAMPLES, IDS_PER_SAMPLE = 16, 8
N_IDS = SAMPLES * IDS_PER_SAMPLE
N_BATCHES = 10


class RowCache:
    def __init__(self, host_table):
        self.host_table = host_table  # pinned [NUM_ROWS, DIM]
        self.cache = torch.zeros(CACHE_SLOTS, DIM, device=DEV)
        self.slot_of = {}  # row -> slot
        self.lru = OrderedDict()  # slot -> row, least recently used first
        self.free_slots = list(range(CACHE_SLOTS - 1, -1, -1))
        self.stream = torch.cuda.Stream(device=DEV)
        self.stage_rows = torch.empty(CACHE_SLOTS, DIM, pin_memory=True)
        self.stage_idx = torch.empty(CACHE_SLOTS + N_IDS, dtype=torch.long, pin_memory=True)
        self.stage_free = torch.cuda.Event()  # staging buffers may be rewritten
        self.fwd_done = None  # event recorded after the latest enqueued forward

    def _assign_slots(self, uniq, locked):
        wanted = set(uniq)
        misses, slots = [], []
        for r in uniq:
            if r in self.slot_of:
                self.lru.move_to_end(self.slot_of[r])
                continue
            if self.free_slots:
                s = self.free_slots.pop()
            else:
                s = next(s for s, row in self.lru.items()
                         if row not in locked and row not in wanted)
                del self.slot_of[self.lru.pop(s)]
            self.slot_of[r] = s
            self.lru[s] = r
            misses.append(r)
            slots.append(s)
        return misses, slots

    def prefetch(self, ids, locked):
        """Make every row in `ids` resident; returns (slot per id on GPU, ready event)."""
        misses, slots = self._assign_slots(sorted(set(ids.tolist())), locked)
        m = len(misses)
        lookup = torch.tensor([self.slot_of[r] for r in ids.tolist()])
        self.stage_free.synchronize()  # previous upload out of the staging buffers is done
        if m:
            torch.index_select(self.host_table, 0, torch.tensor(misses), out=self.stage_rows[:m])
            self.stage_idx[:m] = torch.tensor(slots)
        self.stage_idx[m:m + N_IDS] = lookup
        with torch.cuda.stream(self.stream):
            idx = self.stage_idx[:m + N_IDS].to(DEV, non_blocking=True)
            if m:
                rows = self.stage_rows[:m].to(DEV, non_blocking=True)
                self.cache.index_copy_(0, idx[:m], rows)  # overwrite evicted slots
            self.stage_free.record()
            ready = torch.cuda.Event()
            ready.record()
        return idx[m:], ready


class Ranker(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def forward(self, cache, lookup, ready):
        main = torch.cuda.current_stream()
        main.wait_event(ready)
        lookup.record_stream(main)
        pooled = cache.cache.index_select(0, lookup).view(SAMPLES, IDS_PER_SAMPLE, DIM).sum(1)
        out = self.mlp(pooled)
        cache.fwd_done = torch.cuda.Event()
        cache.fwd_done.record(main)
        return out


def main():
    g = torch.Generator().manual_seed(0)
    host_table = torch.randn(NUM_ROWS, DIM, generator=g).pin_memory()
    batches = [torch.randint(0, NUM_ROWS, (N_IDS,), generator=g) for _ in range(N_BATCHES)]
    torch.manual_seed(0)
    model = Ranker().to(DEV).eval()
    cache = RowCache(host_table)
    torch.cuda.synchronize()  # table, cache and weights ready

    scores = torch.zeros((), device=DEV)
    with torch.no_grad():
        pending = cache.prefetch(batches[0], locked=set())
        for i in range(N_BATCHES):
            lookup, ready = pending
            if i + 1 < N_BATCHES:  # overlap prefetch(i+1) with forward(i)
                pending = cache.prefetch(batches[i + 1], locked=set(batches[i].tolist()))
            scores += model(cache, lookup, ready).sum()
            del lookup
    torch.cuda.synchronize()
    print(f"{N_BATCHES} batches, {len(cache.slot_of)} rows cached, score {scores.item():.4f}")


if __name__ == "__main__":
    main()
