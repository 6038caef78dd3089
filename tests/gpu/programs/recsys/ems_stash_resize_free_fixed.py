# Source: meta-pytorch/torchrec PR #4218 "Fix the NaN issue due to the memory usage race condition over
#   multiple streams" (memory_stashing.py execute_stash: cpu_buffer.copy_(tensor, non_blocking=True) on a
#   d2h_stream, then tensor.untyped_storage().resize_(0) on the host; the fix adds
#   tensor.record_stream(d2h_stream)) and PR #4231 (benchmark that reproduces the corruption).
"""Embedding-table memory stashing: while only the dense tower runs, the TBE weights are copied to
pinned host memory on a side stream and their HBM is handed back to the caching allocator; the dense
activations then reuse that HBM. Afterwards the weights are restored from the host copy."""
from contextlib import contextmanager

import torch

SLEEP_CYCLES = 20_000_000
DEV = torch.device("cuda", 0)
ROWS, DIM, NUM_TABLES = 8192, 128, 3


class MemoryStash:
    def __init__(self):
        self.d2h_stream = torch.cuda.Stream()
        self._stashed = []  # (tensor, pinned host copy, nbytes)
        self._host_buffers = []  # kept until the end of the run
        self._d2h_done = None

    def execute_stash(self, tensors):
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_stream(compute)
            # the D2H stream is still draining an earlier checkpoint copy
            torch.cuda._sleep(SLEEP_CYCLES)
            for t in tensors:
                cpu_buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                cpu_buffer.copy_(t, non_blocking=True)
                self._stashed.append((t, cpu_buffer, t.untyped_storage().nbytes()))
                self._host_buffers.append(cpu_buffer)
            self._d2h_done = self.d2h_stream.record_event()
        for t, _, _ in self._stashed:
            # FIX: the D2H copy on d2h_stream still reads t; defer reuse of its block until it is done
            t.record_stream(self.d2h_stream)
            t.untyped_storage().resize_(0)  # release the HBM to the caching allocator

    def execute_restore(self):
        compute = torch.cuda.current_stream()
        compute.wait_event(self._d2h_done)
        for t, cpu_buffer, nbytes in self._stashed:
            t.untyped_storage().resize_(nbytes)
            t.copy_(cpu_buffer, non_blocking=True)
        self._stashed.clear()

    @contextmanager
    def stashed(self, tensors):
        self.execute_stash(tensors)
        try:
            yield
        finally:
            self.execute_restore()


def dense_tower(x, weights):
    acts = []
    h = x
    for w in weights:
        h = torch.relu(h @ w)
        acts.append(h)  # kept for a backward pass
    return acts


def main():
    torch.manual_seed(0)
    x = torch.randn(ROWS, DIM, device=DEV)
    dense_weights = [torch.randn(DIM, DIM, device=DEV) * 0.1 for _ in range(NUM_TABLES)]
    dense_tower(x, dense_weights)  # warm-up: cuBLAS workspace is allocated before the tables
    tables = [torch.randn(ROWS, DIM, device=DEV) for _ in range(NUM_TABLES)]  # TBE weights_dev
    expected = [t.cpu() for t in tables]
    torch.cuda.synchronize()

    stash = MemoryStash()
    with stash.stashed(tables):
        acts = dense_tower(x, dense_weights)
        dense_out = acts[-1].sum()
    torch.cuda.synchronize()

    restored = torch.cat([t.cpu() for t in tables])
    ref = torch.cat(expected)
    match = torch.equal(restored, ref)
    checksum, ref_checksum, dense = restored.abs().sum().item(), ref.abs().sum().item(), dense_out.item()
    torch.cuda.synchronize()
    print(f"checksum={checksum:.4f} reference={ref_checksum:.4f} dense={dense:.4f} match={match}")


if __name__ == "__main__":
    main()
