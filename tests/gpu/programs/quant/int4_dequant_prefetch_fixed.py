# Source: FMInference/FlexLLMGen (FlexGen), flexllmgen/flex_opt.py OptLM.generation_loop_overlap_single_batch /
#   load_weight() on self.load_weight_stream, with group-wise 4-bit weight compression from
#   flexllmgen/compression.py TorchCompressedDevice.compress/decompress (num_bits=4, group_size=64, per-group
#   min/scale). FlexGen calls self.sync() (torch.cuda.synchronize) after every layer; this variant overlaps
#   better: it decompresses layer j+1 on load_weight_stream while layer j computes and orders the two with a
#   per-layer event instead of a device-wide sync.
# Bug: the decompressed fp32 weight is allocated on load_weight_stream (its owner in the caching allocator) and
#   read by the matmul on the default stream; compute_layer() then drops it without
#   `w.record_stream(default stream)`. The allocator hands the freed block to the next decompress on
#   load_weight_stream at once, whose kernels overwrite it while the default stream (busy with attention) has
#   not yet run the matmul that reads it. Race: default-stream read of weight_read_buf[j] (matmul) vs
#   load_weight_stream writes into the same recycled block (decompress of layer j+2).
# Fix: call w.record_stream(torch.cuda.current_stream()) before dropping the weight in compute_layer().
import torch

DEV = "cuda:0"
HIDDEN = 1024
TOKENS = 64
N_LAYERS = 6
GEN_LEN = 3
GROUP = 64
NUM_BITS = 4
ATTN_CYCLES = 20_000_000  # attention + kv-cache work of one layer on the default stream


class CompressedWeight:
    def __init__(self, packed, scale, mn, shape):
        self.packed, self.scale, self.mn, self.shape = packed, scale, mn, shape


def compress(w, group_size=GROUP, num_bits=NUM_BITS):
    """Asymmetric group-wise quantization along the input dim, two 4-bit codes per byte."""
    b = 2 ** num_bits - 1
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group_size, group_size)
    mn = g.amin(dim=-1, keepdim=True)
    mx = g.amax(dim=-1, keepdim=True)
    scale = b / (mx - mn)
    q = ((g - mn) * scale).clamp_(0, b).round_().to(torch.uint8).reshape(out_f, in_f)
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    return CompressedWeight(packed.contiguous(), scale, mn, w.shape)


def decompress(cw, group_size=GROUP):
    out_f, in_f = cw.shape
    hi = cw.packed >> 4
    lo = cw.packed & 0xF
    q = torch.stack((hi, lo), dim=-1).reshape(out_f, in_f).float()
    g = q.reshape(out_f, in_f // group_size, group_size) / cw.scale + cw.mn
    return g.reshape(out_f, in_f)


class OptLM:
    def __init__(self, weight_home):
        self.weight_home = weight_home  # compressed weights resident on the GPU (TorchCompressedDevice)
        self.num_layers = len(weight_home)
        self.load_weight_stream = torch.cuda.Stream()
        self.load_weight_stream.wait_stream(torch.cuda.current_stream())  # weight_home was built on default
        self.weight_read_buf = [None] * self.num_layers
        self.load_events = [None] * self.num_layers

    def load_weight(self, j):
        with torch.cuda.stream(self.load_weight_stream):
            self.weight_read_buf[j] = decompress(self.weight_home[j])
            self.load_events[j] = self.load_weight_stream.record_event()

    def compute_layer(self, j, h):
        torch.cuda.current_stream().wait_event(self.load_events[j])
        w = self.weight_read_buf[j]
        self.weight_read_buf[j] = None
        torch.cuda._sleep(ATTN_CYCLES)
        h = torch.relu(h @ w.t())
        w.record_stream(torch.cuda.current_stream())  # FIX: block allocated on load_weight_stream, read here
        return h

    def generate(self, h):
        self.load_weight(0)
        outs = []
        for i in range(GEN_LEN):
            for j in range(self.num_layers):
                last = i == GEN_LEN - 1 and j == self.num_layers - 1
                if not last:
                    self.load_weight((j + 1) % self.num_layers)
                h = self.compute_layer(j, h)
            outs.append(h)
        return outs


@torch.no_grad()
def main():
    torch.manual_seed(0)
    weights = [torch.randn(HIDDEN, HIDDEN, device=DEV) * (2.0 / HIDDEN) ** 0.5 for _ in range(N_LAYERS)]
    weight_home = [compress(w) for w in weights]
    h0 = torch.randn(TOKENS, HIDDEN, device=DEV)

    model = OptLM(weight_home)
    outs = model.generate(h0)
    torch.cuda.synchronize()

    # reference: decompress everything up front on the default stream, no side stream
    ref_w = [decompress(cw) for cw in weight_home]
    h = h0
    ok = True
    for i in range(GEN_LEN):
        for j in range(N_LAYERS):
            h = torch.relu(h @ ref_w[j].t())
        ok &= torch.allclose(outs[i], h, rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
    print(f"max|d|={(outs[-1] - h).abs().max().item():.4g}")
    print(f"match={bool(ok)}")


if __name__ == "__main__":
    main()
