# Source: vLLM online (dynamic) FP8 quantization, vllm/model_executor/layers/quantization/fp8.py:
#   Fp8LinearMethod.process_weights_after_loading() quantizes the just-loaded bf16 weight with
#   ops.scaled_fp8_quant(layer.weight, scale=None) and then drops the bf16 copy; here the loader streams layers in
#   and quantizes each one on a side stream (overlapping the next layer's H2D), and releases the bf16 storage with
#   Tensor.set_() onto an empty storage (the `weight.set_(torch.empty(0, ...))` idiom of quantization shims), so that
#   the parameter object survives but its memory goes back to the caching allocator.
# Bug: the bf16 weight of layer i is allocated and filled (H2D) on the default stream and read by the FP8
#   quantization on quant_stream; `layer.weight.set_(empty)` then drops its storage on the host without
#   record_stream(quant_stream). The default stream's next allocation (layer i+1's bf16 weight) gets the same block
#   at once and its H2D copy overwrites it while the quantization kernels on quant_stream have not read layer i yet,
#   so layer i is quantized from layer i+1's weights.
# Fix: record quant_stream on the bf16 weight before set_() swaps its storage out, so the allocator keeps the block
#   until the quantization work enqueued so far has finished.
import torch
import torch.nn as nn

NUM_LAYERS, DIM = 6, 2048
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
QUANT_DELAY = 20_000_000    # cycles: the quantization kernels run late (the stream also serves other work)


def scaled_fp8_quant(w: torch.Tensor):
    """Per-tensor dynamic FP8 quantization (ops.scaled_fp8_quant with scale=None)."""
    scale = w.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
        self.qweight = None
        self.weight_scale = None

    def forward(self, x):
        w = (self.qweight.float() * self.weight_scale).to(torch.bfloat16)
        return x @ w.t()


class StreamingFp8Loader:
    def __init__(self, device):
        self.device = device
        self.quant_stream = torch.cuda.Stream()

    def load_layer(self, layer: Fp8Linear, cpu_weight: torch.Tensor):
        w = torch.empty(cpu_weight.shape, dtype=cpu_weight.dtype, device=self.device)
        w.copy_(cpu_weight, non_blocking=True)                      # H2D on the default stream
        layer.weight = nn.Parameter(w, requires_grad=False)
        del w
        self.quant_stream.wait_stream(torch.cuda.current_stream())  # weight is loaded
        with torch.cuda.stream(self.quant_stream):
            torch.cuda._sleep(QUANT_DELAY)
            layer.qweight, layer.weight_scale = scaled_fp8_quant(layer.weight)
        self.release_bf16_weight(layer)

    def release_bf16_weight(self, layer: Fp8Linear):
        # quant_stream read this storage: keep the block until that work is done
        layer.weight.record_stream(self.quant_stream)
        with torch.no_grad():
            layer.weight.set_(torch.empty(0, dtype=torch.bfloat16, device=self.device))

    def finish(self):
        torch.cuda.current_stream().wait_stream(self.quant_stream)


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    cpu_weights = [(torch.randn(DIM, DIM) * 0.02).to(torch.bfloat16).pin_memory() for _ in range(NUM_LAYERS)]
    layers = nn.ModuleList([Fp8Linear() for _ in range(NUM_LAYERS)])
    loader = StreamingFp8Loader(dev)
    for layer, cpu_w in zip(layers, cpu_weights):
        loader.load_layer(layer, cpu_w)
    loader.finish()

    x = torch.randn(64, DIM, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        y = x
        for layer in layers:
            y = layer(y)
        torch.cuda.synchronize()
        ok = True
        ref = x
        for layer, cpu_w in zip(layers, cpu_weights):
            q_ref, s_ref = scaled_fp8_quant(cpu_w.to(dev))
            ok = ok and torch.equal(layer.qweight.float(), q_ref.float()) and torch.equal(layer.weight_scale, s_ref)
            ref = ref @ (q_ref.float() * s_ref).to(torch.bfloat16).t()
        ok = ok and torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-3)
    print(f"match={ok}")


if __name__ == "__main__":
    main()
