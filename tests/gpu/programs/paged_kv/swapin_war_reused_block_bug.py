# Source: vllm-project/vllm issue #47282 ("SimpleCPUOffload: ... load path lacks
# cross-stream sync with compute (WAR)"), fixed by PR #47291 / #50863: record one
# compute-done event per step and make the CPU->GPU loads wait on it.
# Plain-torch model: ops.swap_blocks' per-block cudaMemcpyAsync becomes a per-block
# non_blocking copy_ from a pinned CPU block view, issued on a dedicated load stream.
#
# BUG: a request finishes, its GPU blocks go back to the free queue and are handed
# out at once as load destinations for the next request (prefix hit in the CPU
# cache).  The load stream is not ordered after the compute stream, whose decode
# step (index_select over the finished request's block table) still reads them.
import torch

DEV = torch.device("cuda:0")
NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 48, 64
BLOCK, HEADS, DIM = 16, 8, 64
BLOCKS_PER_REQ = 6


def async_h2d(values):
    """vllm.utils.async_tensor_h2d: pinned staging tensor + non_blocking copy."""
    t = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return t.to(DEV, non_blocking=True)


class FreeBlockQueue:
    def __init__(self, n):
        self.free = list(range(n))

    def alloc(self, k):
        out, self.free = self.free[:k], self.free[k:]
        return out

    def release(self, blocks):
        # most recently freed blocks are handed out first
        self.free = list(blocks) + self.free


class OffloadWorker:
    def __init__(self):
        shape = (BLOCK, 2, HEADS, DIM)
        self.gpu_kv = torch.zeros(NUM_GPU_BLOCKS, *shape, device=DEV, dtype=torch.float16)
        self.cpu_kv = torch.randn(NUM_CPU_BLOCKS, *shape, dtype=torch.float16).pin_memory()
        self.load_stream = torch.cuda.Stream()
        self.load_done = torch.cuda.Event()
        self.compute_done = torch.cuda.Event()

    def prefill(self, blocks):  # compute stream: reshape_and_cache for whole blocks
        kv = torch.randn(len(blocks), BLOCK, 2, HEADS, DIM, device=DEV, dtype=torch.float16)
        self.gpu_kv.index_copy_(0, async_h2d(blocks), kv)

    def attend(self, q, block_table):  # compute stream: paged decode attention
        kv = self.gpu_kv.index_select(0, async_h2d(block_table))
        k = kv[:, :, 0].reshape(-1, HEADS, DIM)
        v = kv[:, :, 1].reshape(-1, HEADS, DIM)
        p = torch.einsum("hd,thd->ht", q, k).float().div(DIM ** 0.5).softmax(-1)
        return torch.einsum("ht,thd->hd", p.half(), v)

    def start_load(self, cpu_blocks, gpu_blocks):  # CPU -> GPU on the load stream
        with torch.cuda.stream(self.load_stream):
            for c, g in zip(cpu_blocks, gpu_blocks):
                self.gpu_kv[g].copy_(self.cpu_kv[c], non_blocking=True)
            self.load_done.record()

    def wait_for_load(self):
        torch.cuda.current_stream().wait_event(self.load_done)


def main():
    torch.manual_seed(0)
    worker = OffloadWorker()
    pool = FreeBlockQueue(NUM_GPU_BLOCKS)
    torch.cuda.synchronize()  # setup done before any side-stream work

    running = pool.alloc(BLOCKS_PER_REQ)
    worker.prefill(running)
    outs, cpu_cursor = [], 0
    for step in range(4):
        q = torch.randn(HEADS, DIM, device=DEV, dtype=torch.float16)
        outs.append(worker.attend(q, running))  # last decode step of `running`
        # request finished -> blocks freed; next request has its prefix in CPU
        pool.release(running)
        running = pool.alloc(BLOCKS_PER_REQ)
        cpu_blocks = list(range(cpu_cursor, cpu_cursor + BLOCKS_PER_REQ))
        cpu_cursor += BLOCKS_PER_REQ
        worker.start_load(cpu_blocks, running)
        worker.wait_for_load()
    q = torch.randn(HEADS, DIM, device=DEV, dtype=torch.float16)
    outs.append(worker.attend(q, running))
    torch.cuda.synchronize()
    print("checksum", float(torch.stack(outs).float().abs().sum()))


if __name__ == "__main__":
    main()
