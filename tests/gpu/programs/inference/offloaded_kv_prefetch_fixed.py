# Source: huggingface/transformers src/transformers/cache_utils.py -- Cache.update() with
#   offloading=True (torch.cuda.default_stream(device).wait_stream(self.prefetch_stream);
#   self.prefetch(layer_idx + 1); ...; self.offload(layer_idx)) and CacheLayerMixin.prefetch()
#   (self.keys = self.keys.to(self.device, non_blocking=True) under the prefetch stream).
#   The prefetched GPU tensors are allocated on prefetch_stream, consumed by torch.cat on the
#   default stream in DynamicLayer.update(), and dropped right after without record_stream
#   (a latent pattern found by reading the code, not a reported upstream issue).
# Race (bug): layer L's prefetched keys/values block is returned to the prefetch_stream pool when
#   DynamicLayer.update() rebinds self.keys; prefetch of layer L+2 reuses it and its H2D write on
#   prefetch_stream overtakes the default stream's torch.cat of layer L that still reads it.
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms: q/k/v projections of one layer on the default stream
NUM_LAYERS = 6
BATCH = 2
PAST_LEN = 2048
HEAD_DIM = 128
STEPS = 2


class OffloadedLayer:
    def __init__(self, keys_cpu, values_cpu, device):
        self.device = device
        self.keys = keys_cpu
        self.values = values_cpu

    def prefetch(self):
        if self.keys.device != self.device:
            self.keys = self.keys.to(self.device, non_blocking=True)
            self.values = self.values.to(self.device, non_blocking=True)

    def offload(self):
        self.keys = self.keys.to("cpu", non_blocking=True)
        self.values = self.values.to("cpu", non_blocking=True)

    def update(self, key_states, value_states):
        # FIX: tensors prefetched on prefetch_stream are read here on the default stream; tell the allocator.
        self.keys.record_stream(torch.cuda.current_stream())
        self.values.record_stream(torch.cuda.current_stream())
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values


class Cache:
    def __init__(self, layers, offloading):
        self.layers = layers
        self.offloading = offloading
        if offloading:
            self.prefetch_stream = torch.cuda.Stream()

    def prefetch(self, layer_idx):
        if self.offloading and layer_idx < len(self.layers):
            with torch.cuda.stream(self.prefetch_stream):
                self.layers[layer_idx].prefetch()

    def update(self, key_states, value_states, layer_idx):
        if self.offloading:
            torch.cuda.current_stream().wait_stream(self.prefetch_stream)
            self.prefetch(layer_idx + 1)
        keys, values = self.layers[layer_idx].update(key_states, value_states)
        if self.offloading:
            self.layers[layer_idx].offload()
        return keys, values


class Attention:
    def __init__(self, wq, wk, wv):
        self.wq, self.wk, self.wv = wq, wk, wv

    def __call__(self, x, cache, layer_idx, sleep):
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)
        q = x @ self.wq
        k = (x @ self.wk).unsqueeze(1)
        v = (x @ self.wv).unsqueeze(1)
        keys, values = cache.update(k, v, layer_idx)
        scores = (keys * q.unsqueeze(1)).sum(-1) / HEAD_DIM**0.5
        probs = torch.softmax(scores.float(), dim=-1)
        return x + (probs.unsqueeze(-1) * values).sum(1)


def decode(attns, cache, x, sleep):
    outs = []
    for _ in range(STEPS):
        cache.prefetch(0)
        for i, attn in enumerate(attns):
            x = attn(x, cache, i, sleep)
        outs.append(x)
        if int(x.argmax()) < 0:  # generate()'s stopping-criteria check: a host sync per step
            break
    return torch.stack(outs).cpu()


def main():
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(5)
    weights = [[torch.randn(HEAD_DIM, HEAD_DIM, generator=g) / HEAD_DIM**0.5 for _ in range(3)] for _ in range(NUM_LAYERS)]
    past = [(torch.randn(BATCH, PAST_LEN, HEAD_DIM, generator=g), torch.randn(BATCH, PAST_LEN, HEAD_DIM, generator=g)) for _ in range(NUM_LAYERS)]
    x0 = torch.randn(BATCH, HEAD_DIM, generator=g).to(device)
    attns = [Attention(*(w.to(device) for w in ws)) for ws in weights]
    with torch.inference_mode():
        # Reference: same math with a GPU-resident cache, serial on the default stream.
        ref_cache = Cache([OffloadedLayer(k.to(device), v.to(device), device) for k, v in past], offloading=False)
        reference = decode(attns, ref_cache, x0, sleep=False)
        torch.cuda.synchronize()
        cache = Cache([OffloadedLayer(k.pin_memory(), v.pin_memory(), device) for k, v in past], offloading=True)
        result = decode(attns, cache, x0, sleep=True)
    torch.cuda.synchronize()
    match = torch.allclose(result, reference, rtol=1e-4, atol=1e-4)
    print(f"checksum={float(result.double().sum()):.6f} reference={float(reference.double().sum()):.6f} match={match}")


if __name__ == "__main__":
    main()
