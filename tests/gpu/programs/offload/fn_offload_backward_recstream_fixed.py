# Source: plausible pattern -- a custom torch.autograd.Function (an
#   "offloaded linear") that saves its input to pinned CPU memory on a copy
#   stream in forward and reloads it on the same copy stream in backward, the
#   way hand-written activation offloading in training frameworks does (cf. the
#   record_stream comment in torchtune's OffloadActivations
#   unpack_tensor_with_streams: "we use our frenemy, record_stream, to ensure
#   the Tensor stays unmessed with until it's done getting used in the compute
#   stream").
# Race (bug version): in backward the reloaded input `x` is allocated by the
#   caching allocator on the copy stream (the H2D runs under
#   torch.cuda.stream(copy_stream)) but is read by the grad-weight GEMM on the
#   compute stream.  When backward returns, `x` is freed; the allocator only
#   knows about copy_stream, so the block is immediately handed to the next
#   layer's reload on copy_stream, whose H2D overwrites it while the previous
#   layer's `x.t() @ grad_y` on the compute stream may still be pending
#   -> wrong weight gradients.  (missing record_stream)
# Fix: x.record_stream(compute) after the compute stream waits for the reload.
import torch

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200)


class CopyStreams:
    def __init__(self):
        self.copy_stream = torch.cuda.Stream()


class OffloadedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, streams):
        compute = torch.cuda.current_stream()
        y = x @ w
        copy_stream = streams.copy_stream
        copy_stream.wait_stream(compute)  # x is ready
        with torch.cuda.stream(copy_stream):
            x_cpu = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            x_cpu.copy_(x, non_blocking=True)
        x.record_stream(copy_stream)  # x may be freed by the caller
        ctx.streams = streams
        ctx.x_cpu = x_cpu
        ctx.save_for_backward(w)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (w,) = ctx.saved_tensors
        compute = torch.cuda.current_stream()
        copy_stream = ctx.streams.copy_stream
        with torch.cuda.stream(copy_stream):
            x = ctx.x_cpu.to(grad_y.device, non_blocking=True)
        compute.wait_stream(copy_stream)
        # FIX: x was allocated on copy_stream but is used on the compute stream
        x.record_stream(compute)
        torch.cuda._sleep(SPIN)  # stands in for a long GEMM ahead in the compute stream
        grad_x = grad_y @ w.t()
        grad_w = x.t() @ grad_y
        ctx.x_cpu = None
        return grad_x, grad_w, None


def forward(x, weights, streams=None):
    h = x
    for w in weights:
        h = OffloadedLinear.apply(h, w, streams) if streams else h @ w
        h = torch.tanh(h)
    return h.square().mean()


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    B, D, L, STEPS = 4096, 1024, 6, 3
    weights = [
        (torch.randn(D, D, device=dev) / D**0.5).requires_grad_() for _ in range(L)
    ]
    xs = [torch.randn(B, D, device=dev) for _ in range(STEPS)]

    ref = [torch.zeros_like(w) for w in weights]
    for x in xs:
        for r, g in zip(ref, torch.autograd.grad(forward(x, weights), weights)):
            r += g
    torch.cuda.synchronize()

    streams = CopyStreams()
    for x in xs:
        loss = forward(x, weights, streams)
        loss.backward()
    torch.cuda.synchronize()

    grads = [w.grad for w in weights]
    checksum = sum(g.double().sum().item() for g in grads)
    scale = max(r.abs().max().item() for r in ref)
    err = max((g - r).abs().max().item() for g, r in zip(grads, ref)) / scale
    print(f"checksum={checksum:.8e} rel_err_vs_ref={err:.3e}",
          "OK" if err < 1e-5 else "MISMATCH")


if __name__ == "__main__":
    main()
