# Source: plausible pattern, LMCache-style retrieve path (pinned CPU chunk -> GPU
# staging tensor on a load stream -> scatter into the paged KV cache by slot mapping
# on the compute stream).  The fix mirrors vllm-project/vllm PR #50863 / #47291
# ("record one compute-done event per step and make loads wait on it"); the
# missing-record_stream class is the one described in meta-pytorch/torchrec PR #4231.
#
# BUG: each chunk's staging tensor is allocated on the load stream, read by
# index_copy_ on the compute stream, then dropped without
# staging.record_stream(compute).  The next load allocates a staging tensor of the
# same size on the load stream (same block) and its H2D copy overwrites it while the
# previous scatter may still be reading it; the load stream never waits for compute.
import torch

DEV = torch.device("cuda:0")
NUM_GPU_BLOCKS, BLOCK, HEADS, DIM = 128, 16, 8, 64
CHUNK_TOKENS, NUM_CHUNKS = 256, 6


class KVRetriever:
    def __init__(self):
        self.gpu_kv = torch.zeros(NUM_GPU_BLOCKS, BLOCK, 2, HEADS, DIM, device=DEV,
                                  dtype=torch.float16)
        self.kv_slots = self.gpu_kv.view(-1, 2, HEADS, DIM)
        self.cpu_store = torch.randn(NUM_CHUNKS, CHUNK_TOKENS, 2, HEADS, DIM,
                                     dtype=torch.float16).pin_memory()
        self.load_stream = torch.cuda.Stream()
        self.load_done = torch.cuda.Event()
        self.compute_done = torch.cuda.Event()

    def load_chunk(self, chunk_id):  # CPU -> GPU staging on the load stream
        with torch.cuda.stream(self.load_stream):
            staging = torch.empty(CHUNK_TOKENS, 2, HEADS, DIM, device=DEV,
                                  dtype=torch.float16)
            staging.copy_(self.cpu_store[chunk_id], non_blocking=True)
            self.load_done.record()
        return staging

    def scatter(self, staging, slot_mapping):  # compute stream
        torch.cuda.current_stream().wait_event(self.load_done)
        self.kv_slots.index_copy_(0, slot_mapping, staging)


def retrieve(retriever, chunk_id, slot_mapping):
    staging = retriever.load_chunk(chunk_id)
    retriever.scatter(staging, slot_mapping)
    # the last reference to `staging` dies here


def attend(gpu_kv, block_ids):
    kv = gpu_kv.index_select(0, block_ids)
    q = torch.randn(HEADS, DIM, device=DEV, dtype=torch.float16)
    k, v = kv[:, :, 0].reshape(-1, HEADS, DIM), kv[:, :, 1].reshape(-1, HEADS, DIM)
    p = torch.einsum("hd,thd->ht", q, k).float().div(DIM ** 0.5).softmax(-1)
    return torch.einsum("ht,thd->hd", p.half(), v)


def main():
    torch.manual_seed(0)
    r = KVRetriever()
    blocks_per_chunk = CHUNK_TOKENS // BLOCK
    # block tables and slot mappings, built once on the GPU
    perm = torch.randperm(NUM_GPU_BLOCKS, device=DEV)[:NUM_CHUNKS * blocks_per_chunk]
    tables = perm.view(NUM_CHUNKS, blocks_per_chunk)
    offs = torch.arange(BLOCK, device=DEV)
    slot_maps = (tables[:, :, None] * BLOCK + offs).reshape(NUM_CHUNKS, CHUNK_TOKENS)
    torch.cuda.synchronize()  # setup done before any side-stream work

    outs = []
    for c in range(NUM_CHUNKS):  # a long prompt whose prefix is retrieved chunk by chunk
        retrieve(r, c, slot_maps[c])
        outs.append(attend(r.gpu_kv, tables[: c + 1].reshape(-1)))
    torch.cuda.synchronize()
    print("checksum", float(torch.stack(outs).float().abs().sum()))


if __name__ == "__main__":
    main()
