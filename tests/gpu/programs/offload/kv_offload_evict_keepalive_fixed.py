# Source: plausible pattern modelled on layer-wise KV-cache offloading in a
#   decode loop (transformers OffloadedCache in cache_utils.py: prefetch the
#   layer's KV from pinned CPU on a prefetch stream, evict the updated KV back
#   to CPU after the layer), with the eviction moved to its own stream; the
#   keep-alive fix mirrors torchtune OffloadActivations' fwd_stash ("Stash to
#   keep activation alive til s1 is done").
# Race (bug version): after a layer appends the new token, the full K/V
#   tensors (allocated by torch.cat on the default stream) are copied D2H into
#   the pinned cache on the offload stream, and then simply dropped when the
#   layer function returns.  The caching allocator only knows the default
#   stream, so the very next layer's torch.cat on the default stream gets the
#   same block and overwrites it while the D2H copy is still queued on the
#   offload stream (device-device WAR through allocator block reuse).  The CPU
#   cache then holds the wrong layer's K/V and later decode steps diverge.
# Fix: keep the evicted GPU tensors alive until the D2H is known to be ordered
#   before the default stream: they are held until the same layer's next
#   fetch, whose prefetch stream waits on the eviction event and which the
#   default stream then waits on.
import torch

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200)


class OffloadedKVCache:
    def __init__(self, init_k, init_v, max_len):
        num_layers = len(init_k)
        s0, heads, head_dim = init_k[0].shape
        self.k_cpu = [torch.empty(max_len, heads, head_dim, pin_memory=True)
                      for _ in range(num_layers)]
        self.v_cpu = [torch.empty(max_len, heads, head_dim, pin_memory=True)
                      for _ in range(num_layers)]
        for layer in range(num_layers):
            self.k_cpu[layer][:s0].copy_(init_k[layer])
            self.v_cpu[layer][:s0].copy_(init_v[layer])
        self.length = s0
        self.prefetch_stream = torch.cuda.Stream()
        self.offload_stream = torch.cuda.Stream()
        self.evicted = [torch.cuda.Event() for _ in range(num_layers)]
        self.keep_alive = [None] * num_layers  # FIX

    def fetch(self, layer):
        n = self.length
        with torch.cuda.stream(self.prefetch_stream):
            # the previous step's eviction of this layer must have landed
            self.prefetch_stream.wait_event(self.evicted[layer])
            k = self.k_cpu[layer][:n].to("cuda", non_blocking=True)
            v = self.v_cpu[layer][:n].to("cuda", non_blocking=True)
        compute = torch.cuda.current_stream()
        compute.wait_stream(self.prefetch_stream)
        k.record_stream(compute)
        v.record_stream(compute)
        return k, v

    def evict(self, layer, k_full, v_full):
        n = k_full.shape[0]
        self.offload_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.offload_stream):
            self.k_cpu[layer][:n].copy_(k_full, non_blocking=True)
            self.v_cpu[layer][:n].copy_(v_full, non_blocking=True)
            self.evicted[layer].record(self.offload_stream)
        # FIX: keep the GPU tensors alive; they are released when this layer is
        # evicted again, i.e. after the next fetch made the default stream wait
        # (via the prefetch stream) on self.evicted[layer]
        self.keep_alive[layer] = (k_full, v_full)


def decode_layer(x, k_past, v_past, w):
    heads, head_dim = k_past.shape[1], k_past.shape[2]
    q = (x @ w["q"]).view(heads, 1, head_dim)
    k_full = torch.cat([k_past, (x @ w["k"]).view(1, heads, head_dim)], 0)
    v_full = torch.cat([v_past, (x @ w["v"]).view(1, heads, head_dim)], 0)
    att = torch.softmax(q @ k_full.permute(1, 2, 0) / head_dim**0.5, dim=-1)
    o = (att @ v_full.permute(1, 0, 2)).reshape(1, heads * head_dim)
    return x + torch.tanh(o @ w["o"]), k_full, v_full


def run_layer(cache, layer, x, w):
    k, v = cache.fetch(layer)
    x, k_full, v_full = decode_layer(x, k, v, w)
    cache.evict(layer, k_full, v_full)
    return x


def main():
    torch.manual_seed(0)
    L, H, DH, S0, STEPS = 4, 8, 128, 4096, 8
    D = H * DH
    weights = [{n: torch.randn(D, D, device="cuda") / D**0.5 for n in "qkvo"}
               for _ in range(L)]
    init_k = [torch.randn(S0, H, DH) for _ in range(L)]
    init_v = [torch.randn(S0, H, DH) for _ in range(L)]
    embeds = torch.randn(STEPS, 1, D, device="cuda")

    # reference: KV cache resident on the GPU
    k_gpu = [k.cuda() for k in init_k]
    v_gpu = [v.cuda() for v in init_v]
    ref = []
    for t in range(STEPS):
        x = embeds[t]
        for layer in range(L):
            x, k_gpu[layer], v_gpu[layer] = decode_layer(
                x, k_gpu[layer], v_gpu[layer], weights[layer])
        ref.append(x)
    torch.cuda.synchronize()
    del k_gpu, v_gpu
    torch.cuda.empty_cache()  # start the offloaded run from an empty block cache

    cache = OffloadedKVCache(init_k, init_v, S0 + STEPS)
    outs = []
    for t in range(STEPS):
        # the offload stream is still busy with other transfers
        with torch.cuda.stream(cache.offload_stream):
            torch.cuda._sleep(SPIN)
        x = embeds[t]
        for layer in range(L):
            x = run_layer(cache, layer, x, weights[layer])
        cache.length += 1
        outs.append(x)
    torch.cuda.synchronize()

    out = torch.cat(outs)
    refs = torch.cat(ref)
    checksum = out.double().sum().item()
    err = (out - refs).abs().max().item() / refs.abs().max().item()
    print(f"checksum={checksum:.8e} rel_err_vs_ref={err:.3e}",
          "OK" if err < 1e-4 else "MISMATCH")


if __name__ == "__main__":
    main()
