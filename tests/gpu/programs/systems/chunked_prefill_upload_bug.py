"""Chunked-prefill engine: a long prompt is fed through the model in CHUNK-token
chunks.  The embeddings of chunk c+1 are looked up on the CPU into a pinned
staging slot and uploaded on a copy stream while chunk c is computed; the
destination buffer is allocated on the compute stream (where it is consumed)
and the compute stream waits for the upload before using it.

Modeled on: the PyTorch CUDA-semantics note (docs/source/notes/cuda.rst,
"s.wait_stream(torch.cuda.default_stream(cuda))  # NEW!" before using on a side
stream a tensor allocated on the default stream) and microsoft/onnxruntime
PR #5415 (a buffer allocated after a host-side free is filled on another
stream, interleaving with the previous owner's work).  Plausible pattern.

BUG: upload() fills a buffer allocated on the compute stream from the copy
stream without first making the copy stream wait for the compute stream.  The
caching allocator serves that allocation from blocks freed by chunk c-1
(its input buffer / activations), so the H2D write races with chunk c-1's
compute that still reads / writes that memory.
"""
import torch

DEV = torch.device("cuda:0")
VOCAB = 8192
D = 1024
CHUNK = 512
N_CHUNKS = 8
N_LAYERS = 4


class ChunkUploader:
    def __init__(self, cpu_table):
        self.cpu_table = cpu_table  # [VOCAB, D] CPU embedding table
        self.copy_stream = torch.cuda.Stream(device=DEV)
        self.stage = [torch.empty(CHUNK, D, pin_memory=True) for _ in range(2)]
        self.stage_done = [None, None]

    def upload(self, c, ids):
        slot = c % 2
        if self.stage_done[slot] is not None:
            self.stage_done[slot].synchronize()  # slot's previous upload finished
        torch.index_select(self.cpu_table, 0, ids, out=self.stage[slot])
        buf = torch.empty(CHUNK, D, device=DEV)  # allocated on the compute stream
        with torch.cuda.stream(self.copy_stream):
            buf.copy_(self.stage[slot], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.stage_done[slot] = done
        return buf, done


class Stack:
    def __init__(self, gen):
        s = D ** -0.5
        self.w = [(torch.randn(D, D, generator=gen) * s).to(DEV) for _ in range(N_LAYERS)]

    def forward(self, x, kv_summary):
        for w in self.w:
            x = x + torch.relu(x @ w)
            kv_summary += x.sum(0)
        return x


def main():
    gen = torch.Generator().manual_seed(0)
    cpu_table = torch.randn(VOCAB, D, generator=gen)
    prompt = torch.randint(0, VOCAB, (N_CHUNKS * CHUNK,), generator=gen)
    model = Stack(gen)
    uploader = ChunkUploader(cpu_table)
    kv_summary = torch.zeros(D, device=DEV)
    torch.cuda.synchronize()  # weights ready

    main_stream = torch.cuda.current_stream()
    chunks = prompt.split(CHUNK)
    with torch.no_grad():
        nxt = uploader.upload(0, chunks[0])
        for c in range(N_CHUNKS):
            buf, ready = nxt
            if c + 1 < N_CHUNKS:  # overlap chunk c+1's upload with chunk c's compute
                nxt = uploader.upload(c + 1, chunks[c + 1])
            main_stream.wait_event(ready)
            out = model.forward(buf, kv_summary)
            del buf, out
    torch.cuda.synchronize()
    print(f"prefilled {N_CHUNKS * CHUNK} tokens, summary norm {kv_summary.norm().item():.3f}")


if __name__ == "__main__":
    main()
