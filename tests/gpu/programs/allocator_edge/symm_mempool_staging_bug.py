# Source: vLLM NCCL symmetric-memory all-reduce: vllm/distributed/device_communicators/pynccl_allocator.py
#   (nccl_symm_mem_context enters torch.cuda.use_mem_pool(get_nccl_mem_pool()), a torch.cuda.MemPool backed by
#   ncclMemAlloc) and the all_reduce_symmetric_with_copy op (symm_input = torch.empty_like(input) inside the context,
#   symm_input.copy_(input), pynccl_comm.all_reduce(symm_input, out)); used here for gradient reduction overlapped
#   with backward on a communication stream, as Megatron-LM DDP does with overlap_grad_reduce and NCCL user buffers
#   (megatron/core/nccl_allocator.py nccl_mem()). The MemPool uses the default allocator (no NCCL, one rank); the
#   "all-reduce" is the single-rank stand-in out = symm_input * gradient_scaling_factor on the comm stream.
# Bug: the symmetric staging buffer is allocated inside `with torch.cuda.stream(comm_stream), use_mem_pool(pool)`,
#   so its MemPool block belongs to comm_stream, but it is filled (copy_) on the default stream. When
#   all_reduce_async() returns, the buffer is dropped; the next call allocates in the pool on comm_stream, gets the
#   same block, and the default stream's copy_ of the next gradient overwrites it while the comm stream's reduction
#   of the previous gradient has not read it yet. The write (default) and the earlier read (comm_stream) of the
#   block's previous life are unordered; record_stream would not help since the new user is the default stream.
# Fix: keep every staging buffer referenced until finish_grad_sync() has made the default stream wait for the comm
#   stream, so no pool block is handed out again while a reduction may still read it.
import torch

NUM_PARAMS, NUMEL, STEPS = 8, 1 << 20, 2
GRAD_SCALING = 1.0 / 8            # 1 / data-parallel size, applied by the all-reduce
COMM_DELAY = 20_000_000           # cycles: NCCL latency stand-in on the comm stream


def nccl_symm_mem_context(pool):
    return torch.cuda.use_mem_pool(pool)


class SymmMemGradReducer:
    def __init__(self, params):
        self.pool = torch.cuda.MemPool()          # vLLM: MemPool(CUDAPluggableAllocator(ncclMemAlloc/ncclMemFree))
        self.comm_stream = torch.cuda.Stream()
        self.main_grads = [torch.zeros_like(p) for p in params]

    def all_reduce_async(self, idx, grad):
        with torch.cuda.stream(self.comm_stream), nccl_symm_mem_context(self.pool):
            symm_input = torch.empty_like(grad)
        symm_input.copy_(grad)                    # stage into registered memory on the compute stream
        self.comm_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.comm_stream):
            torch.cuda._sleep(COMM_DELAY)
            torch.mul(symm_input, GRAD_SCALING, out=self.main_grads[idx])

    def finish_grad_sync(self):
        torch.cuda.current_stream().wait_stream(self.comm_stream)


def backward_grads(acts, step):
    """Gradients as autograd would hand them to the DDP hooks, last layer first (default stream)."""
    for idx in reversed(range(len(acts))):
        yield idx, torch.sin(acts[idx] * (step + 1)) * (idx + 1)


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    params = [torch.empty(NUMEL, device=dev) for _ in range(NUM_PARAMS)]
    acts = [torch.randn(NUMEL, device=dev) for _ in range(NUM_PARAMS)]
    reducer = SymmMemGradReducer(params)
    torch.cuda.synchronize()

    reduced = []
    for step in range(STEPS):
        for idx, grad in backward_grads(acts, step):
            reducer.all_reduce_async(idx, grad)
        reducer.finish_grad_sync()
        reduced.append([g.clone() for g in reducer.main_grads])   # optimizer step reads main_grad
    torch.cuda.synchronize()

    ok = True
    for step in range(STEPS):
        for idx, got in enumerate(reduced[step]):
            expected = torch.sin(acts[idx] * (step + 1)) * (idx + 1) * GRAD_SCALING
            ok = ok and torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    print(f"match={ok}")


if __name__ == "__main__":
    main()
