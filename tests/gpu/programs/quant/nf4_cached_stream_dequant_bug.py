# Source: unslothai/unsloth, unsloth/kernels/utils.py: CUDA_STREAMS built once at import time from
#   torch._C._cuda_getCurrentRawStream(index), fast_dequantize(W, quant_state, use_global_buffer=True) launching
#   the bitsandbytes cdequantize_blockwise_bf16_nf4 kernel on CUDA_STREAMS[device_index] into the shared
#   WEIGHT_BUFFERS[device_index], and matmul_lora() doing torch.matmul(X, W.t()) on the *current* stream
#   (used by LoRA_MLP for gate/up/down). The same file also has _get_tensor_stream(tensor), the *current* raw
#   stream per call, as bitsandbytes' own functional._get_tensor_stream does, but fast_dequantize uses the cached
#   handle. The hazard appears only when the caller runs under a non-default stream, as here. The bitsandbytes
#   kernel is emulated with torch ops launched on the stream handle it is given.
# Bug: the stream was captured at import, so it is always the default stream. When the LoRA forward runs
#   under `with torch.cuda.stream(compute_stream)`, the NF4 dequant writes the global WEIGHT_BUFFER on the
#   default stream while the matmul that reads it runs on compute_stream; nothing orders the two, and the
#   buffer is rewritten for the next projection (up/down, next layer) while earlier matmuls are still queued
#   behind attention work on compute_stream. Race: default-stream write of WEIGHT_BUFFERS[0] (dequant) vs
#   compute_stream read of it (torch.matmul in matmul_lora).
# Fix: launch the dequant kernel on the stream that is current at call time (what _get_tensor_stream returns,
#   here torch.cuda.current_stream(device)), so producer and consumer are the same stream.
import torch
import torch.nn.functional as F

DEV = "cuda:0"
HIDDEN = 1024
INTER = 2048
TOKENS = 128
N_LAYERS = 4
BLOCKSIZE = 64
RANK = 16
ATTN_CYCLES = 20_000_000  # attention part of each decoder layer on compute_stream

NF4_CODE = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0], device=DEV)

# captured once, at import time (the default stream of every device)
_CUDA_STREAMS = {i: torch.cuda.current_stream(i) for i in range(torch.cuda.device_count())}
CUDA_STREAMS = tuple(_CUDA_STREAMS[i] for i in range(len(_CUDA_STREAMS)))
WEIGHT_BUFFERS = [None] * len(CUDA_STREAMS)


class QuantState:
    def __init__(self, absmax, shape, dtype, blocksize):
        self.absmax, self.shape, self.dtype, self.blocksize = absmax, shape, dtype, blocksize


def quantize_nf4(w, blocksize=BLOCKSIZE):
    blocks = w.float().reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    idx = ((blocks / absmax[:, None]).unsqueeze(-1) - NF4_CODE).abs().argmin(dim=-1).to(torch.uint8).reshape(-1)
    packed = (idx[0::2] << 4) | idx[1::2]
    return packed, QuantState(absmax, w.shape, w.dtype, blocksize)


def cdequantize_blockwise_bf16_nf4(W, absmax, out, blocksize, n, stream):
    """Stand-in for the bitsandbytes kernel: runs on the raw stream it is handed."""
    with torch.cuda.stream(stream):
        idx = torch.stack((W >> 4, W & 0xF), dim=-1).reshape(n).long()
        vals = NF4_CODE[idx].view(-1, blocksize) * absmax[:, None]
        out.view(-1, blocksize).copy_(vals)


def fast_dequantize(W, quant_state, use_global_buffer=True):
    device_index = W.device.index
    CUDA_STREAM = CUDA_STREAMS[device_index]
    shape, dtype = quant_state.shape, quant_state.dtype
    size = shape[0] * shape[1]
    if use_global_buffer:
        WEIGHT_BUFFER = WEIGHT_BUFFERS[device_index]
        if WEIGHT_BUFFER is None or WEIGHT_BUFFER.dtype != dtype or WEIGHT_BUFFER.numel() < size:
            WEIGHT_BUFFERS[device_index] = WEIGHT_BUFFER = torch.empty(size, dtype=dtype, device=W.device)
        out = WEIGHT_BUFFER[:size].view(shape)
    else:
        out = torch.empty(shape, dtype=dtype, device=W.device)
    cdequantize_blockwise_bf16_nf4(W, quant_state.absmax, out, quant_state.blocksize, size, CUDA_STREAM)
    return out


def matmul_lora(X, W, W_quant, A, B, s):
    W = fast_dequantize(W, W_quant, use_global_buffer=True)
    out = torch.matmul(X, W.t())
    out.addmm_(torch.matmul(X, A.t()), B.t(), alpha=s)
    return out


class LoRALayer:
    def __init__(self, out_f, in_f):
        w = torch.randn(out_f, in_f, device=DEV, dtype=torch.bfloat16) / in_f ** 0.5
        self.W, self.W_quant = quantize_nf4(w)
        self.A = torch.randn(RANK, in_f, device=DEV, dtype=torch.bfloat16) / in_f ** 0.5
        self.B = torch.randn(out_f, RANK, device=DEV, dtype=torch.bfloat16) * 0.01
        self.s = 2.0


def lora_mlp(X, layer, mm=matmul_lora):
    e = mm(X, layer["gate"].W, layer["gate"].W_quant, layer["gate"].A, layer["gate"].B, layer["gate"].s)
    g = mm(X, layer["up"].W, layer["up"].W_quant, layer["up"].A, layer["up"].B, layer["up"].s)
    h = F.silu(e) * g
    return X + mm(h, layer["down"].W, layer["down"].W_quant, layer["down"].A, layer["down"].B, layer["down"].s)


def ref_matmul_lora(X, W, W_quant, A, B, s):
    w = fast_dequantize(W, W_quant, use_global_buffer=False)  # default stream, private buffer
    out = torch.matmul(X, w.t())
    out.addmm_(torch.matmul(X, A.t()), B.t(), alpha=s)
    return out


@torch.no_grad()
def main():
    torch.manual_seed(0)
    layers = [{"gate": LoRALayer(INTER, HIDDEN), "up": LoRALayer(INTER, HIDDEN), "down": LoRALayer(HIDDEN, INTER)}
              for _ in range(N_LAYERS)]
    X0 = torch.randn(TOKENS, HIDDEN, device=DEV, dtype=torch.bfloat16)

    compute_stream = torch.cuda.Stream()
    compute_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(compute_stream):
        X = X0
        for layer in layers:
            torch.cuda._sleep(ATTN_CYCLES)
            X = lora_mlp(X, layer)
        out = X
    torch.cuda.current_stream().wait_stream(compute_stream)
    torch.cuda.synchronize()

    X = X0
    for layer in layers:
        X = lora_mlp(X, layer, mm=ref_matmul_lora)
    torch.cuda.synchronize()
    rel = ((out.float() - X.float()).norm() / X.float().norm()).item()
    print(f"rel_err={rel:.3e}")
    print(f"match={rel < 1e-3}")


if __name__ == "__main__":
    main()
