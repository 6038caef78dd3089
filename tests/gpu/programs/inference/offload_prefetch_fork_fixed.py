# Source: vllm-project/vllm vllm/model_executor/offloader/prefetch.py (PrefetchOffloader and
#   _ModuleOffloader.start_onload_to_static, adapted from sglang python/sglang/srt/utils/offloader.py):
#   offloaded layer weights live in pinned CPU memory and are prefetched on copy_stream into a
#   StaticBufferPool slot that layers share round-robin (layer i uses slot i % prefetch_step).
#   The code comment there: "We must wait for the compute stream before copying, because the
#   previous layer's forward may still be using the buffer" -> fork_event + copy_stream.wait_event.
# Race (bug): copy_stream's H2D copy of layer i+2's weights into slot i % 2 vs the compute
#   (default) stream's matmul of layer i that still reads that slot.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms: attention and the rest of one decoder layer
NUM_LAYERS = 6
PREFETCH_STEP = 2
HIDDEN = 512
BATCH = 64
STEPS = 3


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = None  # points at a static GPU buffer slot once offloading is set up

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        return (x @ self.weight).clamp_(-4, 4)


class ModuleOffloader:
    def __init__(self, layer, cpu_weight, gpu_buffer, copy_stream):
        self.cpu_weight = cpu_weight  # pinned
        self.gpu_buffer = gpu_buffer  # static slot shared with other layers
        layer.weight = gpu_buffer
        self.copy_stream = copy_stream
        self.copy_done_event = torch.cuda.Event()

    def start_onload_to_static(self):
        fork_event = torch.cuda.Event()
        torch.cuda.current_stream().record_event(fork_event)
        # FIX: the copy may only overwrite the slot after the compute stream is done reading it.
        self.copy_stream.wait_event(fork_event)
        with torch.cuda.stream(self.copy_stream):
            self.gpu_buffer.copy_(self.cpu_weight, non_blocking=True)
        self.copy_done_event.record(self.copy_stream)


class PrefetchOffloader:
    def __init__(self, layers, cpu_weights, device):
        self.copy_stream = torch.cuda.Stream()
        slots = [torch.empty(HIDDEN, HIDDEN, device=device) for _ in range(PREFETCH_STEP)]
        self.offloaders = [
            ModuleOffloader(layer, w, slots[i % PREFETCH_STEP], self.copy_stream)
            for i, (layer, w) in enumerate(zip(layers, cpu_weights))
        ]
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._wait_hook(i))
            layer.register_forward_hook(self._prefetch_hook(i))

    def _wait_hook(self, index):
        def hook(module, args):
            torch.cuda.current_stream().wait_event(self.offloaders[index].copy_done_event)

        return hook

    def _prefetch_hook(self, index):
        def hook(module, args, output):
            next_index = (index + PREFETCH_STEP) % len(self.offloaders)
            self.offloaders[next_index].start_onload_to_static()

        return hook

    def post_init(self):
        for i in range(PREFETCH_STEP):
            self.offloaders[i].start_onload_to_static()


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(NUM_LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def main():
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(3)
    cpu_weights = [torch.randint(-1, 2, (HIDDEN, HIDDEN), generator=g).float().pin_memory() for _ in range(NUM_LAYERS)]
    x_cpu = torch.randint(-4, 5, (BATCH, HIDDEN), generator=g).float()
    model = Decoder()
    offloader = PrefetchOffloader(model.layers, cpu_weights, device)
    x = x_cpu.to(device)
    torch.cuda.synchronize()
    with torch.inference_mode():
        offloader.post_init()
        outs = []
        for _ in range(STEPS):
            x = model(x)
            outs.append(x)
        result = torch.stack(outs).cpu()
    torch.cuda.synchronize()
    ref, ref_outs = x_cpu, []
    for _ in range(STEPS):
        for w in cpu_weights:
            ref = (ref @ w).clamp_(-4, 4)
        ref_outs.append(ref)
    reference = torch.stack(ref_outs)
    print(
        f"checksum={float(result.double().sum()):.1f} "
        f"reference={float(reference.double().sum()):.1f} match={torch.equal(result, reference)}"
    )


if __name__ == "__main__":
    main()
