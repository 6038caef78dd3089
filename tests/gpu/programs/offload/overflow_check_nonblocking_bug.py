# Source: DeepSpeed ZeRO-Offload fp16 overflow check, deepspeedai/DeepSpeed
#   PR #501 (deepspeed/runtime/zero/stage2.py, `_async_has_inf_or_nan`):
#   `cpu_sum = float(async_buff.copy_(x.float().sum(), non_blocking=True))`.
#   Review (samyam): "since copy_ is non-blocking, wouldn't this cause a race
#   condition, where float(async_buff) might get executed before copy_
#   finishes, in which case it will just get the value that was already in
#   async_buff?"
# Race (bug version): the gradient sum is copied D2H into a pinned scalar
#   with non_blocking=True on the compute stream and the host reads the
#   scalar right away, without synchronizing (host-device RAW on pinned
#   memory).  While backward is still running the host sees a stale value, so
#   an fp16 overflow is missed: the offloaded (CPU) optimizer applies inf/nan
#   gradients and the loss scale is not reduced.
# Fix: synchronize the compute stream before reading async_buff on the host.
import torch

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200)
LR, MOMENTUM = 1e-2, 0.9


class OffloadedFP16Optimizer:
    def __init__(self, params, init_scale):
        self.params = params  # fp16 GPU parameters
        self.master = [p.detach().float().cpu() for p in params]  # fp32 on CPU
        self.momentum = [torch.zeros(p.shape) for p in params]
        self.async_buff = torch.zeros((), pin_memory=True)
        self.scale = init_scale
        self.skipped = 0

    @staticmethod
    def _async_has_inf_or_nan(x, async_buff):
        async_buff.copy_(x.float().sum(), non_blocking=True)
        # (missing: torch.cuda.current_stream().synchronize())
        cpu_sum = float(async_buff)
        return cpu_sum in (float("inf"), -float("inf")) or cpu_sum != cpu_sum

    def has_overflow(self, grads):
        return any(self._async_has_inf_or_nan(g, self.async_buff) for g in grads)

    def step(self, grads):
        if self.has_overflow(grads):
            self.scale /= 2
            self.skipped += 1
            return
        for p, m, mom, g in zip(self.params, self.master, self.momentum, grads):
            g32 = g.float().cpu() / self.scale  # blocking D2H
            mom.mul_(MOMENTUM).add_(g32)
            m.add_(mom, alpha=-LR)
            with torch.no_grad():
                p.copy_(m.half())  # blocking H2D


class ReferenceOptimizer(OffloadedFP16Optimizer):
    @staticmethod
    def _async_has_inf_or_nan(x, async_buff):
        cpu_sum = float(x.float().sum())  # blocking .item()
        return cpu_sum in (float("inf"), -float("inf")) or cpu_sum != cpu_sum


def scaled_loss(params, x, y, scale):
    h = x
    for w in params[:-1]:
        h = torch.relu(h @ w)
    return ((h @ params[-1]).float() - y).square().mean() * scale


def train(opt_cls, init, xs, ys, spin):
    params = [p.clone().requires_grad_() for p in init]
    opt = opt_cls(params, init_scale=2.0**32)
    for x, y in zip(xs, ys):
        if spin:
            torch.cuda._sleep(SPIN)  # long forward/backward ahead in the compute stream
        grads = torch.autograd.grad(scaled_loss(params, x, y, opt.scale), params)
        opt.step(grads)
    return opt


def main():
    torch.manual_seed(0)
    B, D, L, STEPS = 2048, 1024, 3, 16
    init = [(torch.randn(D, D, device="cuda") / D**0.5).half() for _ in range(L)]
    xs = [torch.randn(B, D, device="cuda").half() for _ in range(STEPS)]
    ys = [torch.randn(B, D, device="cuda") for _ in range(STEPS)]

    ref = train(ReferenceOptimizer, init, xs, ys, spin=False)
    torch.cuda.synchronize()

    opt = train(OffloadedFP16Optimizer, init, xs, ys, spin=True)
    torch.cuda.synchronize()

    checksum = sum(m.double().sum().item() for m in opt.master)
    err = max((m - r).abs().max().item() for m, r in zip(opt.master, ref.master))
    print(f"checksum={checksum:.8e} skipped={opt.skipped} (ref {ref.skipped})"
          f" scale={opt.scale:g} max_err_vs_ref={err:.3e}",
          "OK" if err < 1e-6 and opt.skipped == ref.skipped else "MISMATCH")


if __name__ == "__main__":
    main()
