"""A DynamicCache-like KV cache that keeps only the layers in use on the GPU:
after a layer's attention its K/V are offloaded (D2H on an offload stream) into
per-layer pinned CPU buffers, and one layer ahead they are prefetched back (H2D
on a prefetch stream).  Host syncs are replaced by CUDA events throughout.

Modeled on: huggingface/transformers OffloadedCache (src/transformers/
cache_utils.py, PR #31325, which orders offload/prefetch with
current_stream().synchronize() and prefetch_stream.synchronize()) and
vllm-project/vllm issues #45704 / #47282 (SimpleCPUOffload: copies on separate
load/store streams launched without a cross-stream event).  This custom cache
is a self-contained re-creation, not transformers' own class.

FIXED: prefetch() makes the prefetch stream wait on offload_done[layer], so the
H2D read of the pinned buffer is ordered after the D2H write into it.
"""
import torch

DEV = torch.device("cuda:0")
N_LAYERS = 4
HEADS, HEAD_DIM = 8, 64
D = HEADS * HEAD_DIM
BATCH = 4
PROMPT = 32
STEPS = 8
MAX_LEN = PROMPT + STEPS


class OffloadedKVCache:
    def __init__(self, n_layers):
        self.offload_stream = torch.cuda.Stream(device=DEV)
        self.prefetch_stream = torch.cuda.Stream(device=DEV)
        shape = (MAX_LEN, BATCH, HEADS, HEAD_DIM)  # time-major: [:T] is contiguous
        self.cpu_k = [torch.empty(shape, pin_memory=True) for _ in range(n_layers)]
        self.cpu_v = [torch.empty(shape, pin_memory=True) for _ in range(n_layers)]
        self.gpu_kv = [None] * n_layers
        self.length = [0] * n_layers
        self.offload_done = [torch.cuda.Event() for _ in range(n_layers)]
        self.prefetch_done = [torch.cuda.Event() for _ in range(n_layers)]

    def offload(self, layer):
        k, v = self.gpu_kv[layer]
        T = k.shape[0]
        self.offload_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.offload_stream):
            self.cpu_k[layer][:T].copy_(k, non_blocking=True)
            self.cpu_v[layer][:T].copy_(v, non_blocking=True)
            self.offload_done[layer].record()
        k.record_stream(self.offload_stream)
        v.record_stream(self.offload_stream)
        self.gpu_kv[layer] = None
        self.length[layer] = T

    def prefetch(self, layer):
        T = self.length[layer]
        with torch.cuda.stream(self.prefetch_stream):
            self.prefetch_stream.wait_event(self.offload_done[layer])
            k = self.cpu_k[layer][:T].to(DEV, non_blocking=True)
            v = self.cpu_v[layer][:T].to(DEV, non_blocking=True)
            self.prefetch_done[layer].record()
        self.gpu_kv[layer] = (k, v)

    def update(self, layer, k_new, v_new):
        if self.gpu_kv[layer] is None:  # prefill: nothing cached yet
            self.gpu_kv[layer] = (k_new, v_new)
            return k_new, v_new
        compute = torch.cuda.current_stream()
        compute.wait_event(self.prefetch_done[layer])
        k, v = self.gpu_kv[layer]
        k.record_stream(compute)
        v.record_stream(compute)
        self.gpu_kv[layer] = (torch.cat([k, k_new]), torch.cat([v, v_new]))
        return self.gpu_kv[layer]


class TinyDecoder:
    def __init__(self, gen):
        s = D ** -0.5
        self.w = [[(torch.randn(D, D, generator=gen) * s).to(DEV) for _ in range(4)]
                  for _ in range(N_LAYERS)]

    def forward(self, x, cache, decoding, more_steps):
        # x: [T, B, D] time-major activations
        T = x.shape[0]
        for l, (wq, wk, wv, wo) in enumerate(self.w):
            if decoding and l + 1 < N_LAYERS:
                cache.prefetch(l + 1)  # overlap the next layer's H2D with this layer
            elif decoding and more_steps:
                cache.prefetch(0)  # layer 0 of the next decode step
            q = (x @ wq).view(T, BATCH, HEADS, HEAD_DIM)
            k_new = (x @ wk).view(T, BATCH, HEADS, HEAD_DIM)
            v_new = (x @ wv).view(T, BATCH, HEADS, HEAD_DIM)
            k, v = cache.update(l, k_new, v_new)
            scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * HEAD_DIM ** -0.5
            if T > 1:
                causal = torch.ones(T, T, device=DEV, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(causal, float("-inf"))
            attn = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
            x = x + attn.reshape(T, BATCH, D) @ wo
            cache.offload(l)
        return x


def main():
    gen = torch.Generator().manual_seed(0)
    model = TinyDecoder(gen)
    cache = OffloadedKVCache(N_LAYERS)
    prompt = torch.randn(PROMPT, BATCH, D, generator=gen).to(DEV)
    torch.cuda.synchronize()  # weights and prompt ready

    outs = []
    with torch.no_grad():
        h = model.forward(prompt, cache, decoding=False, more_steps=True)
        cache.prefetch(0)
        x = torch.tanh(h[-1:])
        for step in range(STEPS):
            h = model.forward(x, cache, decoding=True, more_steps=step + 1 < STEPS)
            x = torch.tanh(h)
            outs.append(h)
    torch.cuda.synchronize()
    print(f"decoded {STEPS} steps, checksum {torch.cat(outs).abs().sum().item():.3f}")


if __name__ == "__main__":
    main()
