"""stash_resize_free (fixed version).

Source: meta-pytorch/torchrec#4218 "Fix the NaN issue due to the memory usage race condition
over multiple streams" (memory_stashing.execute_stash) and the repro benchmark #4231:
embedding weights allocated on the default stream are copied D2H on a side stream
(cpu_buffer.copy_(tensor, non_blocking=True)), then their HBM is released on the host with
tensor.untyped_storage().resize_(0) -- the same idiom as FSDP's _free_storage().  Without
tensor.record_stream(d2h_stream) the caching allocator hands the bytes to the next
default-stream allocation (the dense tower) while the D2H copy may still be reading them.
torch.cuda.empty_cache() is called between steps with work still queued (as a memory-saving
job would); it is not part of the bug.

Fix: t.record_stream(d2h) before resize_(0), as in torchrec#4218.
"""
import torch

DEV = torch.device("cuda", 0)
ROWS, DIM = 49152, 128          # each embedding table: 24 MiB (its own allocator segment)
B, DD = 6144, 1024              # dense activation 6144 x 1024 fp32: also 24 MiB
STEPS = 3


class MemoryStash:
    """Moves a set of CUDA tensors to pinned host memory and back (torchrec-style)."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.nbytes = [t.untyped_storage().nbytes() for t in tensors]
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        self.d2h = torch.cuda.Stream(DEV)

    def stash(self):
        self.d2h.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(self.d2h):
            for t, buf in zip(self.tensors, self.host):
                buf.copy_(t, non_blocking=True)         # D2H copy reads t on the d2h stream
        for t in self.tensors:
            t.record_stream(self.d2h)                   # FIX (torchrec#4218): d2h used it
            t.untyped_storage().resize_(0)              # give the HBM back to the allocator

    def restore(self):
        cur = torch.cuda.current_stream(DEV)
        cur.wait_stream(self.d2h)
        for t, buf, n in zip(self.tensors, self.host, self.nbytes):
            t.untyped_storage().resize_(n)
            t.copy_(buf, non_blocking=True)


class TinyDLRM:
    def __init__(self):
        self.tables = [torch.randn(ROWS, DIM, device=DEV).mul_(0.01) for _ in range(2)]
        self.w_dense = torch.randn(DD, DD, device=DEV).mul_(DD ** -0.5)
        self.stash = MemoryStash(self.tables)

    def step(self, ids, dense_x):
        emb = torch.cat([torch.nn.functional.embedding(ids, t) for t in self.tables], dim=1)
        self.stash.stash()                      # tables leave HBM while the dense tower runs
        h = torch.matmul(dense_x, self.w_dense).relu_()      # 24 MiB, default stream
        z = (h[:, : 2 * DIM] * emb).sum(dim=1)
        self.stash.restore()                    # tables are needed again by the next lookup
        return z.mean()


def main():
    torch.manual_seed(0)
    model = TinyDLRM()
    ids = [torch.randint(0, ROWS, (B,), device=DEV) for _ in range(STEPS)]
    dense = [torch.randn(B, DD, device=DEV) for _ in range(STEPS)]
    outs = []
    for step in range(STEPS):
        outs.append(model.step(ids[step], dense[step]))
        torch.cuda.empty_cache()                # work from this step is still in flight
    torch.cuda.synchronize()
    print("loss", round(torch.stack(outs).sum().item(), 4),
          "table norm", round(model.tables[0].norm().item(), 4))


if __name__ == "__main__":
    main()
