# Source: plausible pattern built on vLLM v0 copy-on-write: BlockSpaceManager.append_slot()
# returns (src, dst) when the last block is shared (parallel sampling / forked
# prefix), the worker passes blocks_to_copy to CacheEngine.copy() (copy_blocks) before
# the model writes the new token.  Here the COW copy is moved to a side "cache" stream
# to overlap with other work (cf. Avarok-Cybersecurity/atlas issue #1193, a prefix cache
# sharing a partially filled tail block with no COW at all).
# Plain torch: copy_blocks = index_select + index_copy_ on the cache stream,
# reshape_and_cache = index_put_ with (block, offset) index tensors.
#
# BUG: the compute stream appends each sequence's new token (index_put_) without
# waiting for copy_done: it writes offset 8 of the COW destination blocks while the
# block copy is still writing them, and writes offset 8 of the shared source block
# while the copy is still reading it.
import torch

DEV = torch.device("cuda:0")
NUM_BLOCKS, BLOCK, HEADS, DIM = 64, 16, 8, 64
PROMPT_LEN, NUM_SAMPLES = 40, 4


def async_h2d(values):
    t = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return t.to(DEV, non_blocking=True)


class PagedCache:
    def __init__(self):
        self.kv = torch.zeros(NUM_BLOCKS, BLOCK, 2, HEADS, DIM, device=DEV,
                              dtype=torch.float16)
        self.cache_stream = torch.cuda.Stream()
        self.copy_done = torch.cuda.Event()

    def copy_blocks(self, src_to_dst):
        # the source tail block was last written on the compute stream
        self.cache_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.cache_stream):
            src = async_h2d([s for s, _ in src_to_dst])
            dst = async_h2d([d for _, d in src_to_dst])
            self.kv.index_copy_(0, dst, self.kv.index_select(0, src))
            self.copy_done.record()

    def append_tokens(self, blocks, offsets, new_kv):  # compute stream
        self.kv.index_put_((async_h2d(blocks), async_h2d(offsets)), new_kv)

    def attend(self, q, block_table):
        kv = self.kv.index_select(0, async_h2d(block_table))
        k, v = kv[:, :, 0].reshape(-1, HEADS, DIM), kv[:, :, 1].reshape(-1, HEADS, DIM)
        p = torch.einsum("hd,thd->ht", q, k).float().div(DIM ** 0.5).softmax(-1)
        return torch.einsum("ht,thd->hd", p.half(), v)


class Sequence:
    def __init__(self, block_table, length):
        self.block_table, self.length = list(block_table), length


def main():
    torch.manual_seed(0)
    cache = PagedCache()
    free = list(range(NUM_BLOCKS))
    ref_count = {}
    torch.cuda.synchronize()  # setup done before any side-stream work

    outs = []
    for prompt in range(2):
        n_blocks = (PROMPT_LEN + BLOCK - 1) // BLOCK
        table, free = free[:n_blocks], free[n_blocks:]
        slots_b = [table[t // BLOCK] for t in range(PROMPT_LEN)]
        slots_o = [t % BLOCK for t in range(PROMPT_LEN)]
        cache.append_tokens(slots_b, slots_o, torch.randn(
            PROMPT_LEN, 2, HEADS, DIM, device=DEV, dtype=torch.float16))  # prefill
        seqs = [Sequence(table, PROMPT_LEN) for _ in range(NUM_SAMPLES)]  # fork n=4
        for b in table:
            ref_count[b] = NUM_SAMPLES
        for step in range(3):
            # append_slot: a shared, partially filled tail block is copied on write
            cow = []
            for s in seqs:
                tail = s.block_table[-1]
                if ref_count[tail] > 1:
                    new, free = free[0], free[1:]
                    ref_count[tail] -= 1
                    ref_count[new] = 1
                    s.block_table[-1] = new
                    cow.append((tail, new))
            if cow:
                cache.copy_blocks(cow)
            blocks = [s.block_table[s.length // BLOCK] for s in seqs]
            offsets = [s.length % BLOCK for s in seqs]
            new_kv = torch.randn(len(seqs), 2, HEADS, DIM, device=DEV, dtype=torch.float16)
            cache.append_tokens(blocks, offsets, new_kv)
            for s in seqs:
                s.length += 1
                q = torch.randn(HEADS, DIM, device=DEV, dtype=torch.float16)
                outs.append(cache.attend(q, s.block_table))
    torch.cuda.synchronize()
    print("checksum", float(torch.stack(outs).float().abs().sum()))


if __name__ == "__main__":
    main()
