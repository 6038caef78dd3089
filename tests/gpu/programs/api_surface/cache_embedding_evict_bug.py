# Source: hpcaitech/ColossalAI colossalai/legacy/nn/parallel/layers/cache_embedding/cache_mgr.py -- CachedParamMgr
#   with async_copy=True: `_prepare_rows_on_cuda` copies evicted rows GPU->CPU with
#   `with torch.cuda.stream(None): evict_out_rows_cpu.copy_(evict_out_rows_gpu, non_blocking=True)` and then calls
#   `_wait_for_data(evict_out_rows_cpu, None)`, which returns at once when stream is None, before
#   `self.weight.view(...).index_copy_(0, evict_info.cpu(), evict_out_rows_cpu)`.  In ColossalAI the blocking
#   `evict_info.cpu()` happens to synchronize the default stream; this variant keeps the slot maps on the host
#   (numpy) to avoid per-batch D2H syncs, so nothing synchronizes any more.
# Bug: torch.cuda.stream(None) is a no-op, so the D2H copy of the evicted rows runs on the default stream behind
#   the previous batch's update; _wait_for_data(t, None) does nothing, and the host's index_copy_ reads the pinned
#   evict_out_rows_cpu while the non_blocking D2H copy into it is still queued: host-device race on the pinned
#   eviction buffer; stale rows are written back into the CPU embedding table.
# Fix: after the copy, torch.cuda.current_stream().synchronize() -- the stream the copy was issued on -- before the
#   host reads evict_out_rows_cpu.
import numpy as np
import torch

DENSE_CYCLES = 25_000_000  # dense part of the model (interaction + MLP fwd/bwd) on the default stream


def _wait_for_data(t, stream):
    if stream is None:
        return
    torch.cuda.current_stream().wait_stream(stream)
    t.record_stream(torch.cuda.current_stream())


class CachedParamMgr:
    def __init__(self, weight, cuda_row_num, device, async_copy=True):
        self.num_embeddings, self.embedding_dim = weight.shape
        self.cuda_row_num = cuda_row_num
        self.device = device
        self.weight = weight.pin_memory()  # pin_weight=True
        self.cuda_cached_weight = torch.zeros(cuda_row_num, self.embedding_dim, device=device)
        self.cached_idx_map = np.full(cuda_row_num, -1, dtype=np.int64)  # gpu row -> cpu row
        self.inverted_cached_idx = np.full(self.num_embeddings, -1, dtype=np.int64)  # cpu row -> gpu row
        self.batch_flags = np.full(cuda_row_num, -1, dtype=np.int64)  # last batch that used a gpu row
        self._async_copy = async_copy
        self._memcpy_stream = torch.cuda.Stream() if async_copy else None

    def _cuda_index(self, idx):
        return torch.from_numpy(np.ascontiguousarray(idx)).pin_memory().to(self.device, non_blocking=True)

    @torch.no_grad()
    def prepare_ids(self, ids, batch_pointer):
        cpu_row_idxs = np.unique(ids)
        comm_cpu_row_idxs = cpu_row_idxs[self.inverted_cached_idx[cpu_row_idxs] == -1]
        self._prepare_rows_on_cuda(comm_cpu_row_idxs, cpu_row_idxs)
        gpu_row_idxs = self.inverted_cached_idx[ids]
        self.batch_flags[self.inverted_cached_idx[cpu_row_idxs]] = batch_pointer
        return self._cuda_index(gpu_row_idxs)

    def _prepare_rows_on_cuda(self, cpu_row_idxs, evict_backlist):
        available = int((self.cached_idx_map == -1).sum())
        evict_num = len(cpu_row_idxs) - available
        if self._async_copy:  # move evict-in rows to the gpu on the memcpy stream
            evict_in_rows_cpu = self.weight.index_select(0, torch.from_numpy(cpu_row_idxs)).pin_memory()
            with torch.cuda.stream(self._memcpy_stream):
                evict_in_rows_gpu = evict_in_rows_cpu.to(self.device, non_blocking=True)
        if evict_num > 0:
            protected = np.isin(self.cached_idx_map, evict_backlist)
            candidates = np.nonzero((self.cached_idx_map != -1) & ~protected)[0]
            evict_gpu_row_idxs = candidates[np.argsort(self.batch_flags[candidates], kind="stable")[:evict_num]]
            evict_info = self.cached_idx_map[evict_gpu_row_idxs]
            evict_out_rows_gpu = self.cuda_cached_weight.index_select(0, self._cuda_index(evict_gpu_row_idxs))
            evict_out_rows_cpu = torch.empty_like(evict_out_rows_gpu, device="cpu", pin_memory=True)
            with torch.cuda.stream(None):
                evict_out_rows_cpu.copy_(evict_out_rows_gpu, non_blocking=True)
            _wait_for_data(evict_out_rows_cpu, None)
            self.weight.index_copy_(0, torch.from_numpy(evict_info), evict_out_rows_cpu)
            self.cached_idx_map[evict_gpu_row_idxs] = -1
            self.inverted_cached_idx[evict_info] = -1
            self.batch_flags[evict_gpu_row_idxs] = -1
        slots = np.nonzero(self.cached_idx_map == -1)[0][: len(cpu_row_idxs)]
        if self._async_copy:
            _wait_for_data(evict_in_rows_gpu, self._memcpy_stream)
        self.cuda_cached_weight.index_copy_(0, self._cuda_index(slots), evict_in_rows_gpu)
        self.cached_idx_map[slots] = cpu_row_idxs
        self.inverted_cached_idx[cpu_row_idxs] = slots

    @torch.no_grad()
    def flush(self):
        rows = np.nonzero(self.cached_idx_map != -1)[0]
        self.weight.index_copy_(0, torch.from_numpy(self.cached_idx_map[rows]),
                                self.cuda_cached_weight[torch.from_numpy(rows).to(self.device)].cpu())


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    num_embeddings, dim, batch_size = 8192, 64, 768
    weight = torch.randn(num_embeddings, dim)
    reference = weight.clone()
    mgr = CachedParamMgr(weight, cuda_row_num=1024, device=device)
    rng = np.random.default_rng(0)

    for step in range(8):
        ids = rng.choice(num_embeddings, size=batch_size, replace=False)  # unique ids: deterministic update
        gpu_rows = mgr.prepare_ids(ids, step)
        update = torch.full((batch_size, dim), 0.25 * (step + 1), device=device)
        torch.cuda._sleep(DENSE_CYCLES)
        mgr.cuda_cached_weight.index_add_(0, gpu_rows, update)  # sparse SGD step on the cached rows
        reference[torch.from_numpy(ids)] += 0.25 * (step + 1)

    mgr.flush()
    torch.cuda.synchronize(device)
    diff = (mgr.weight - reference).abs().max().item()
    print(f"max|diff|={diff:.3g}")
    print(f"match={torch.equal(mgr.weight, reference)}")


if __name__ == "__main__":
    main()
