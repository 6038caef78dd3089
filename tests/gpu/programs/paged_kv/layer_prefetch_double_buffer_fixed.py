# Source: layer-wise loading of CPU-offloaded KV for long contexts, as in
# sgl-project/sglang HiCacheController (LayerLoadingEvent / LayerDoneCounter: the load
# stream records one event per layer and attention layer i waits on it) and the
# FlexGen / ZeRO-Inference double-buffered prefetch.  The slot-reuse WAR is a
# plausible pattern (no specific upstream issue); it is the same write-after-read
# class as vllm-project/vllm issue #47282.
# Plain torch: the offloaded KV lives in one pinned tensor [L, T, 2, H, D]; the GPU
# holds a 2-slot staging tensor; the prefetch of layer l+1 (slot (l+1)%2) overlaps the
# attention of layer l (slot l%2).
#
# FIXED version. The bug was: prefetch(l + 2) reuses slot l % 2 but the load stream never waits for the
# attention of layer l, which is still reading that slot.
import torch

DEV = torch.device("cuda:0")
LAYERS, CTX, HEADS, DIM, STEPS = 8, 2048, 8, 64, 3


class OffloadedKV:
    def __init__(self):
        self.cpu_kv = torch.randn(LAYERS, CTX, 2, HEADS, DIM,
                                  dtype=torch.float16).pin_memory()
        self.gpu_buf = torch.empty(2, CTX, 2, HEADS, DIM, device=DEV, dtype=torch.float16)
        self.load_stream = torch.cuda.Stream()
        self.load_done = [torch.cuda.Event() for _ in range(2)]
        self.compute_done = [torch.cuda.Event() for _ in range(2)]

    def prefetch(self, layer):
        slot = layer % 2
        # FIX: the slot's previous reader (attention of layer - 2) must be done
        self.load_stream.wait_event(self.compute_done[slot])
        with torch.cuda.stream(self.load_stream):
            self.gpu_buf[slot].copy_(self.cpu_kv[layer], non_blocking=True)
            self.load_done[slot].record()

    def wait_layer(self, layer):  # LayerLoadingEvent.wait
        torch.cuda.current_stream().wait_event(self.load_done[layer % 2])

    def release_layer(self, layer):  # attention of `layer` has been enqueued
        self.compute_done[layer % 2].record()


class Decoder:
    def __init__(self):
        self.wo = torch.randn(LAYERS, HEADS * DIM, HEADS * DIM, device=DEV,
                              dtype=torch.float16) / (HEADS * DIM) ** 0.5

    def attention(self, layer, h, kv):
        q = h.view(HEADS, DIM)
        k, v = kv[:, 0], kv[:, 1]
        p = torch.einsum("hd,thd->ht", q, k).float().div(DIM ** 0.5).softmax(-1)
        o = torch.einsum("ht,thd->hd", p.half(), v).reshape(-1)
        return h + o @ self.wo[layer]


def decode_step(kv, model, h):
    kv.prefetch(0)
    kv.prefetch(1)
    for layer in range(LAYERS):
        kv.wait_layer(layer)
        h = model.attention(layer, h, kv.gpu_buf[layer % 2])
        kv.release_layer(layer)
        if layer + 2 < LAYERS:
            kv.prefetch(layer + 2)
    return h


def main():
    torch.manual_seed(0)
    kv, model = OffloadedKV(), Decoder()
    h = torch.randn(HEADS * DIM, device=DEV, dtype=torch.float16)
    torch.cuda.synchronize()  # setup done before any side-stream work
    outs = []
    for _ in range(STEPS):
        h = decode_step(kv, model, h)
        outs.append(h)
    torch.cuda.synchronize()
    print("checksum", float(torch.stack(outs).float().abs().sum()))


if __name__ == "__main__":
    main()
