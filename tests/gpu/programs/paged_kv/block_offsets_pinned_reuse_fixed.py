# Source: NVIDIA/TensorRT-LLM PR #15546 ("Stage KV block offsets through a fresh host
# buffer", nvbug 6293536): copy_batch_block_offsets shipped the per-iteration block
# offset tables with an async H2D from a persistently reused pinned host buffer that
# the next iteration overwrote in place while the overlap scheduler ran ahead.  See
# also vllm-project/vllm PR #32799 (step N async copies vs step N+1 buffer updates).
# Plain torch: a CpuGpuBuffer-like double-buffered pinned block table written through
# its numpy view, copied to the GPU with copy_(non_blocking=True) on the compute
# stream, consumed by index_select-based paged attention.
#
# FIXED version. The bug was: the buffer has two slots but no completion event per slot, so at step i the
# host rewrites slot i % 2 while the H2D copy of step i-2 may still be reading it.
import numpy as np
import torch

DEV = torch.device("cuda:0")
MAX_REQS, MAX_BLOCKS, NUM_SLOTS = 8, 16, 2
NUM_GPU_BLOCKS, BLOCK, HEADS, DIM = 128, 16, 8, 64


class BlockOffsetBuffer:
    def __init__(self):
        self.cpu = torch.zeros(NUM_SLOTS, MAX_REQS, MAX_BLOCKS, dtype=torch.int64,
                               pin_memory=True)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.int64, device=DEV)
        self.copy_done = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        self.step = 0

    def copy_batch_block_offsets(self, block_tables):
        s = self.step % NUM_SLOTS
        self.copy_done[s].synchronize()  # FIX: the H2D that last read slot s is done
        host = self.np[s]
        host[:] = 0
        for i, table in enumerate(block_tables):
            host[i, :len(table)] = table
        n = len(block_tables)
        self.gpu[:n].copy_(self.cpu[s, :n], non_blocking=True)
        self.copy_done[s].record()
        self.step += 1
        return self.gpu[:n]


class PagedAttention:
    def __init__(self):
        self.kv = torch.randn(NUM_GPU_BLOCKS, BLOCK, 2, HEADS, DIM, device=DEV,
                              dtype=torch.float16)

    def forward(self, q, offsets, num_blocks):
        outs = []
        for i, nb in enumerate(num_blocks):
            kv = self.kv.index_select(0, offsets[i, :nb])
            k, v = kv[:, :, 0].reshape(-1, HEADS, DIM), kv[:, :, 1].reshape(-1, HEADS, DIM)
            p = torch.einsum("hd,thd->ht", q[i], k).float().div(DIM ** 0.5).softmax(-1)
            outs.append(torch.einsum("ht,thd->hd", p.half(), v))
        return torch.stack(outs)


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    buf, attn = BlockOffsetBuffer(), PagedAttention()
    torch.cuda.synchronize()  # setup done before any side-stream work

    block_tables = [list(rng.choice(NUM_GPU_BLOCKS, 4, replace=False)) for _ in range(6)]
    results = []
    for it in range(12):  # overlap scheduler: no host<->GPU sync per iteration
        for t in block_tables:  # every request grows by one block every 4 steps
            if it % 4 == 3 and len(t) < MAX_BLOCKS:
                t.append(int(rng.integers(NUM_GPU_BLOCKS)))
        offsets = buf.copy_batch_block_offsets(block_tables)
        q = torch.randn(len(block_tables), HEADS, DIM, device=DEV, dtype=torch.float16)
        results.append(attn.forward(q, offsets, [len(t) for t in block_tables]))
    torch.cuda.synchronize()
    print("iters", len(results), "checksum",
          float(torch.stack(results).float().abs().sum()))


if __name__ == "__main__":
    main()
