# Source: vllm-project/vllm-ascend issue #13501 ("Async scheduling can prematurely
# free in-flight sliding-window KV blocks") and vllm-project/vllm PR #47653 (defer the
# sliding-window mid-flight block free; the host-side alternative to the event fix
# #47291 for the load-path WAR race #47282).  Numbers follow the issue: window 128,
# block 32, request at 158 computed tokens.
# Plain torch: the load = H2D into a staging tensor + index_copy_ into the paged pool
# on a load stream; attention = index_select over the window's block ids.
#
# BUG: under async scheduling the scheduler prunes sliding-window blocks with the
# optimistic num_computed_tokens (it already counts the token still in flight), so it
# frees block 0 while the in-flight step still reads position 31 from it.  Block 0
# is then reused as the destination of a CPU->GPU prefix load on the load stream,
# which (by design) is not ordered after compute: the load's write races the read.
import torch

DEV = torch.device("cuda:0")
NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 32, 16
BLOCK, WINDOW, HEADS, DIM = 32, 128, 8, 64


def async_h2d(values):
    t = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return t.to(DEV, non_blocking=True)


class BlockPool:
    def __init__(self, n):
        self.free = list(range(n))

    def alloc(self, k):
        out, self.free = self.free[:k], self.free[k:]
        return out

    def release(self, blocks):
        self.free = list(blocks) + self.free  # LIFO reuse


class SlidingWindowRequest:
    def __init__(self, block_table, num_computed):
        self.block_table = block_table
        self.num_computed = num_computed  # advanced at schedule time (optimistic)
        self.num_in_flight = 0            # scheduled but output not processed yet


def num_skipped_blocks(num_tokens):
    return max(0, (num_tokens - WINDOW + 1) // BLOCK)


def remove_skipped_blocks(req, pool):
    n = num_skipped_blocks(req.num_computed)
    freed = [b for b in req.block_table[:n] if b is not None]
    req.block_table[:n] = [None] * n
    pool.release(freed)


class Worker:
    def __init__(self):
        self.gpu_kv = torch.zeros(NUM_GPU_BLOCKS, BLOCK, 2, HEADS, DIM, device=DEV,
                                  dtype=torch.float16)
        self.kv_slots = self.gpu_kv.view(-1, 2, HEADS, DIM)
        self.cpu_kv = torch.randn(NUM_CPU_BLOCKS, BLOCK, 2, HEADS, DIM,
                                  dtype=torch.float16).pin_memory()
        self.load_stream = torch.cuda.Stream()
        self.load_done = torch.cuda.Event()

    def write_kv(self, slots):  # compute stream (reshape_and_cache)
        kv = torch.randn(len(slots), 2, HEADS, DIM, device=DEV, dtype=torch.float16)
        self.kv_slots.index_copy_(0, async_h2d(slots), kv)

    def attend(self, block_ids):  # compute stream
        kv = self.gpu_kv.index_select(0, async_h2d(block_ids))
        q = torch.randn(HEADS, DIM, device=DEV, dtype=torch.float16)
        k, v = kv[:, :, 0].reshape(-1, HEADS, DIM), kv[:, :, 1].reshape(-1, HEADS, DIM)
        p = torch.einsum("hd,thd->ht", q, k).float().div(DIM ** 0.5).softmax(-1)
        return torch.einsum("ht,thd->hd", p.half(), v)

    def load_async(self, cpu_start, gpu_blocks):  # CPU -> free GPU blocks
        n = len(gpu_blocks)
        with torch.cuda.stream(self.load_stream):
            staging = torch.empty(n, BLOCK, 2, HEADS, DIM, device=DEV, dtype=torch.float16)
            staging.copy_(self.cpu_kv[cpu_start:cpu_start + n], non_blocking=True)
            self.gpu_kv.index_copy_(0, async_h2d(gpu_blocks), staging)
            self.load_done.record()


def window_blocks(req, pos):
    first = (pos - WINDOW + 1) // BLOCK if pos >= WINDOW else 0
    return [req.block_table[i] for i in range(first, pos // BLOCK + 1)]


def main():
    torch.manual_seed(0)
    pool, worker = BlockPool(NUM_GPU_BLOCKS), Worker()
    torch.cuda.synchronize()  # setup done before any side-stream work

    r = SlidingWindowRequest(pool.alloc(5), num_computed=0)  # prefill 158 tokens
    worker.write_kv([r.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(158)])
    r.num_computed = 158
    outs, pending, q_req = [], None, None
    for step in range(4):
        # ---- schedule (host runs one step ahead of the GPU) ----
        remove_skipped_blocks(r, pool)
        if step == 1:  # new request with a 2-block prefix hit in the CPU cache
            q_req = pool.alloc(2)
            worker.load_async(0, q_req)
        pos = r.num_computed
        if pos // BLOCK >= len(r.block_table):
            r.block_table += pool.alloc(1)
        r.num_computed += 1
        r.num_in_flight += 1
        # ---- execute ----
        worker.write_kv([r.block_table[pos // BLOCK] * BLOCK + pos % BLOCK])
        out = worker.attend(window_blocks(r, pos))
        if q_req is not None:
            torch.cuda.current_stream().wait_event(worker.load_done)
            out = out + worker.attend(q_req)
        outs.append(out)
        # ---- process the previous step's output (one step late) ----
        if pending is not None:
            pending.tolist()  # blocking D2H of the sampled output
            r.num_in_flight -= 1
        pending = out.argmax(-1)
    torch.cuda.synchronize()
    print("table", r.block_table, "prefix blocks", q_req,
          "checksum", float(torch.stack(outs).float().abs().sum()))


if __name__ == "__main__":
    main()
