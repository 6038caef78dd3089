# Source: SGLang diffusion runtime, python/sglang/multimodal_gen/runtime/utils/layerwise_offload.py,
#   LayerwiseOffloadManager.prefetch_layer() / release_layer(): each DiT block's weights live in one consolidated
#   pinned CPU buffer; prefetch_layer() allocates one flat GPU buffer on copy_stream, H2D-copies into it, and points
#   every parameter at a slice of it (`target.data = gpu_buffer[off:off+numel].view(shape)`); release_layer() drops
#   them with `target.data = placeholder`. Upstream starts prefetch_layer() with
#   copy_stream.wait_stream(current_stream()); this variant drops that wait so the H2D prefetch never queues behind
#   compute (the copy only reads pinned host memory).
# Bug: layer i's flat buffer is allocated on copy_stream and read, through its parameter views, by layer i's
#   matmuls on the default stream. The post-forward hook of layer i releases the views (the last references), which
#   frees the block back to copy_stream's pool without record_stream. The pre-forward hook of layer i+1 prefetches
#   layer i+2: the new flat buffer on copy_stream gets the same block and the H2D copy overwrites it while layer i's
#   matmuls on the default stream, delayed behind a slow attention kernel, have not read it yet.
# Fix: release_layer() calls record_stream(current compute stream) on each parameter view before dropping it; a
#   view records its whole base block, so the flat buffer is not reused until the compute stream has passed.
import torch
import torch.nn as nn

NUM_LAYERS, DIM, TOKENS, DENOISE_STEPS = 6, 1024, 512, 2
ATTN_DELAY = 25_000_000   # cycles: the block's attention kernel, before the MLP reads its weights


class DiTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM, dtype=torch.bfloat16)
        self.fc2 = nn.Linear(DIM, DIM, dtype=torch.bfloat16)

    def forward(self, x):
        torch.cuda._sleep(ATTN_DELAY)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class LayerwiseOffloadManager:
    def __init__(self, layers: nn.ModuleList, device):
        self.layers, self.device = layers, device
        self.copy_stream = torch.cuda.Stream()
        self.cpu_buffers, self.meta, self.events, self.gpu_layers = {}, {}, {}, set()
        self.placeholder = torch.empty((1,), dtype=torch.bfloat16, device=device)
        for i, layer in enumerate(layers):
            params = dict(layer.named_parameters())
            total = sum(p.numel() for p in params.values())
            buf = torch.empty(total, dtype=torch.bfloat16, pin_memory=True)
            off, meta = 0, {}
            for name, p in params.items():
                buf[off:off + p.numel()].copy_(p.detach().flatten())
                meta[name] = (off, p.numel(), p.shape)
                p.data = self.placeholder
                off += p.numel()
            self.cpu_buffers[i], self.meta[i] = buf, meta
        self.prefetch_layer(0)
        torch.cuda.current_stream().wait_stream(self.copy_stream)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._make_pre_hook(i))
            layer.register_forward_hook(self._make_post_hook(i))

    def prefetch_layer(self, i):
        if i >= len(self.layers) or i in self.gpu_layers:
            return
        with torch.cuda.stream(self.copy_stream):
            gpu_buffer = torch.empty(self.cpu_buffers[i].shape, dtype=torch.bfloat16, device=self.device)
            gpu_buffer.copy_(self.cpu_buffers[i], non_blocking=True)
            params = dict(self.layers[i].named_parameters())
            for name, (off, numel, shape) in self.meta[i].items():
                params[name].data = gpu_buffer[off:off + numel].view(shape)
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        self.events[i] = event
        self.gpu_layers.add(i)

    def release_layer(self, i):
        self.events.pop(i, None)
        compute_stream = torch.cuda.current_stream()
        for name, p in self.layers[i].named_parameters():
            # p is a slice of the layer's flat GPU buffer: recording the view protects the whole buffer
            p.data.record_stream(compute_stream)
            p.data = self.placeholder
        self.gpu_layers.discard(i)

    def _make_pre_hook(self, i):
        def hook(module, args):
            if i in self.events:
                torch.cuda.current_stream().wait_event(self.events[i])
            self.prefetch_layer((i + 1) % len(self.layers))
        return hook

    def _make_post_hook(self, i):
        def hook(module, args, output):
            self.release_layer(i)
        return hook


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    layers = nn.ModuleList([DiTBlock() for _ in range(NUM_LAYERS)])      # built on CPU, like a checkpoint load
    ref_layers = [DiTBlock().to(dev) for _ in range(NUM_LAYERS)]
    for ref, layer in zip(ref_layers, layers):
        ref.load_state_dict(layer.state_dict())
    LayerwiseOffloadManager(layers, dev)
    latents = torch.randn(TOKENS, DIM, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()

    with torch.no_grad():
        x = latents
        for _ in range(DENOISE_STEPS):
            for layer in layers:
                x = layer(x)
        torch.cuda.synchronize()
        ref = latents
        for _ in range(DENOISE_STEPS):
            for layer in ref_layers:
                ref = layer(ref)
        torch.cuda.synchronize()
    print(f"match={torch.allclose(x.float(), ref.float(), rtol=1e-2, atol=1e-2)}")


if __name__ == "__main__":
    main()
