# Source: vllm-project/vllm, vllm/model_executor/layers/fused_moe/modular_kernel.py FusedMoEModularKernel with
#   the class-level SharedResizableBuffer scratch (fused_out / workspace13 / workspace2 "shared across
#   FusedMoEModularKernel instances (layers), to save memory and allocations"), under dual batch overlap
#   (vllm/v1/worker/ubatching.py UBatchContext: two micro-batches share one compute_stream and one comm_stream
#   and hand over with gpu_compute_done_event / gpu_comm_done_event). vLLM later keyed the buffers by
#   dbo_current_ubatch_id() "to avoid cross-ubatch contamination". The experts are emulated as a w8a8 fp8
#   block-scaled (128x128 weight blocks, per-token-group activation scales) DeepGEMM-style MLP.
# Bug: both micro-batches take their expert output from the same shared fused_out buffer. Micro-batch 0's
#   experts write fused_out on compute_stream and hand over to comm_stream (event) for the combine; while the
#   combine waits on the all-to-all, micro-batch 1's experts run on compute_stream and write the same fused_out.
#   Nothing orders micro-batch 1's write after micro-batch 0's combine read. Race: compute_stream write of the
#   shared fused_out buffer (ubatch 1 experts) vs comm_stream read of it (ubatch 0 combine).
# Fix: index the shared buffer sets by dbo_current_ubatch_id(), one set per micro-batch.
import torch
import torch.nn.functional as F

DEV = "cuda:0"
FP8_MAX = 448.0
BLK = 128
HIDDEN = 1024
INTER = 1024
TOKENS = 256  # per micro-batch
N_LAYERS = 4
A2A_CYCLES = 20_000_000  # all-to-all combine latency on comm_stream

_CURRENT_UBATCH = [0]


def dbo_current_ubatch_id():
    return _CURRENT_UBATCH[0]


class SharedResizableBuffer:
    def __init__(self):
        self.buffer = None

    def get(self, shape, device, dtype):
        numel = 1
        for s in shape:
            numel *= s
        if self.buffer is None or self.buffer.numel() < numel or self.buffer.dtype != dtype:
            self.buffer = torch.empty(numel, device=device, dtype=dtype)
        return self.buffer[:numel].view(*shape)


class SharedBuffers:
    def __init__(self):
        self.fused_out = SharedResizableBuffer()
        self.workspace13 = SharedResizableBuffer()


def per_token_group_quant_fp8(x, out_q=None):
    m, k = x.shape
    xg = x.float().view(m, k // BLK, BLK)
    scale = xg.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (xg / scale[..., None]).to(torch.float8_e4m3fn).view(m, k)
    if out_q is None:
        return q, scale
    out_q.copy_(q)
    return out_q, scale


def quant_weight_block(w):
    n, k = w.shape
    wb = w.view(n // BLK, BLK, k // BLK, BLK)
    scale = wb.abs().amax(dim=(1, 3)).clamp(min=1e-10) / FP8_MAX
    return (wb / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k), scale


def w8a8_block_fp8_matmul(a_q, a_s, w_q, w_s):
    m, k = a_q.shape
    n = w_q.shape[0]
    a = (a_q.float().view(m, k // BLK, BLK) * a_s[..., None]).view(m, k)
    w = (w_q.float().view(n // BLK, BLK, k // BLK, BLK) * w_s[:, None, :, None]).view(n, k)
    return a @ w.t()


class FusedMoEModularKernel:
    shared_buffers = [SharedBuffers(), SharedBuffers()]

    def __init__(self):
        self.w1_q, self.w1_s = quant_weight_block(torch.randn(2 * INTER, HIDDEN, device=DEV) / HIDDEN ** 0.5)
        self.w2_q, self.w2_s = quant_weight_block(torch.randn(HIDDEN, INTER, device=DEV) / INTER ** 0.5)

    def forward(self, hidden):
        bufs = self.shared_buffers[dbo_current_ubatch_id()]  # FIX: one buffer set per micro-batch
        m = hidden.shape[0]
        a1q, a1s = per_token_group_quant_fp8(hidden)
        mm1 = w8a8_block_fp8_matmul(a1q, a1s, self.w1_q, self.w1_s)
        act = F.silu(mm1[:, :INTER]) * mm1[:, INTER:]
        a2q_buf = bufs.workspace13.get((m, INTER), hidden.device, torch.float8_e4m3fn)
        a2q, a2s = per_token_group_quant_fp8(act, out_q=a2q_buf)
        fused_out = bufs.fused_out.get((m, HIDDEN), hidden.device, torch.bfloat16)
        fused_out.copy_(w8a8_block_fp8_matmul(a2q, a2s, self.w2_q, self.w2_s))
        return fused_out


class UBatchContext:
    def __init__(self, ubatch_id, compute_stream, comm_stream):
        self.id = ubatch_id
        self.compute_stream, self.comm_stream = compute_stream, comm_stream
        self.gpu_compute_done_event = torch.cuda.Event()
        self.gpu_comm_done_event = torch.cuda.Event()

    # yield_and_switch_from_compute_to_comm = _signal_compute_done(); _cpu_yield(); _wait_compute_done()
    def signal_compute_done(self):
        self.gpu_compute_done_event.record(self.compute_stream)

    def wait_compute_done(self):
        self.comm_stream.wait_event(self.gpu_compute_done_event)

    # yield_and_switch_from_comm_to_compute = _signal_comm_done(); _cpu_yield(); _wait_comm_done()
    def signal_comm_done(self):
        self.gpu_comm_done_event.record(self.comm_stream)

    def wait_comm_done(self):
        self.compute_stream.wait_event(self.gpu_comm_done_event)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    layers = [FusedMoEModularKernel() for _ in range(N_LAYERS)]
    x0 = [torch.randn(TOKENS, HIDDEN, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    hidden = [x.clone() for x in x0]  # per-ubatch residual stream, updated by the combine
    torch.cuda.synchronize()

    compute_stream, comm_stream = torch.cuda.Stream(), torch.cuda.Stream()
    ctxs = [UBatchContext(u, compute_stream, comm_stream) for u in range(2)]
    # The two ubatch threads' CPU yields are replayed here in the order the DBO schedule produces them.
    for layer in layers:
        outs = [None, None]
        for ctx in ctxs:  # ubatch runs its experts, signals compute done and yields the CPU to the other one
            _CURRENT_UBATCH[0] = ctx.id
            with torch.cuda.stream(compute_stream):
                outs[ctx.id] = layer.forward(hidden[ctx.id])
            ctx.signal_compute_done()
        for ctx in ctxs:  # resumed: switch to comm, combine (all-to-all back), signal comm done, yield
            _CURRENT_UBATCH[0] = ctx.id
            ctx.wait_compute_done()
            with torch.cuda.stream(comm_stream):
                torch.cuda._sleep(A2A_CYCLES)
                hidden[ctx.id].add_(outs[ctx.id])
            ctx.signal_comm_done()
        for ctx in ctxs:  # resumed: back on compute_stream for the next layer
            ctx.wait_comm_done()
    torch.cuda.current_stream().wait_stream(compute_stream)
    torch.cuda.current_stream().wait_stream(comm_stream)
    torch.cuda.synchronize()

    # reference: each micro-batch alone, default stream, fresh output tensors
    ok = True
    _CURRENT_UBATCH[0] = 0
    for u in range(2):
        h = x0[u].clone()
        for layer in layers:
            h.add_(layer.forward(h).clone())
        ok &= torch.allclose(hidden[u].float(), h.float(), rtol=1e-2, atol=1e-2)
        print(f"ubatch {u}: max|d|={(hidden[u].float() - h.float()).abs().max().item():.4g}")
    print(f"match={bool(ok)}")


if __name__ == "__main__":
    main()
