# Source: plausible pattern modelled on DeepSpeed ZeRO-Offload
#   (deepspeed/runtime/zero/stage_1_and_2.py copies gradients into pinned CPU
#   buffers with non_blocking=True on a side stream, then DeepSpeedCPUAdam.step
#   updates the fp32 master weights on the host).  Cf. deepspeedai/DeepSpeed
#   PR #3097 "Disable Stage 1&2 CPUAdam pathways": "the C++ side synchronize is
#   not working to block the python code until all data is copied".
# Race (bug version): the D2H gradient copies are enqueued on the copy stream
#   (after it waits for backward), but the host-side Adam step reads the
#   pinned gradient buffers immediately, without synchronizing on the copy
#   (host-device RAW on pinned memory).  With backward still running, the
#   optimizer consumes the previous step's (or uninitialized) gradients.
# Fix: grads_ready.synchronize() before the CPU optimizer touches the buffers.
import torch

SPIN = 20_000_000  # torch.cuda._sleep cycles (~10 ms on H200)
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8


def cpu_adam_(master, grad, exp_avg, exp_avg_sq, step):
    b1, b2 = BETAS
    exp_avg.mul_(b1).add_(grad, alpha=1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (exp_avg_sq / (1 - b2**step)).sqrt_().add_(EPS)
    master.addcdiv_(exp_avg, denom, value=-LR / (1 - b1**step))


class CPUOffloadOptimizer:
    def __init__(self, params):
        self.params = params  # fp32 GPU parameters used by forward/backward
        self.master = [p.detach().cpu().pin_memory() for p in params]
        self.grad_buf = [torch.empty(p.shape, pin_memory=True) for p in params]
        self.exp_avg = [torch.zeros(p.shape) for p in params]
        self.exp_avg_sq = [torch.zeros(p.shape) for p in params]
        self.copy_stream = torch.cuda.Stream()
        self.grads_ready = torch.cuda.Event()
        self.step_count = 0

    def offload_grads(self, grads):
        self.copy_stream.wait_stream(torch.cuda.current_stream())  # backward done
        with torch.cuda.stream(self.copy_stream):
            for g, buf in zip(grads, self.grad_buf):
                buf.copy_(g, non_blocking=True)
            self.grads_ready.record(self.copy_stream)
        for g in grads:
            g.record_stream(self.copy_stream)

    def step(self):
        # (missing: self.grads_ready.synchronize())
        self.step_count += 1
        for m, g, ea, eas in zip(self.master, self.grad_buf, self.exp_avg, self.exp_avg_sq):
            cpu_adam_(m, g, ea, eas, self.step_count)
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)  # blocking H2D (returns when the copy is done)


def loss_fn(params, x, y):
    h = x
    for w in params[:-1]:
        h = torch.relu(h @ w)
    return (h @ params[-1] - y).square().mean()


def reference(init, xs, ys):
    params = [p.clone().requires_grad_() for p in init]
    master = [p.detach().cpu() for p in init]
    ea = [torch.zeros(p.shape) for p in init]
    eas = [torch.zeros(p.shape) for p in init]
    for step, (x, y) in enumerate(zip(xs, ys), 1):
        grads = torch.autograd.grad(loss_fn(params, x, y), params)
        for m, g, a, b in zip(master, grads, ea, eas):
            cpu_adam_(m, g.cpu(), a, b, step)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return master


def main():
    torch.manual_seed(0)
    B, D, L, STEPS = 2048, 1024, 3, 6
    init = [torch.randn(D, D, device="cuda") / D**0.5 for _ in range(L)]
    xs = [torch.randn(B, D, device="cuda") for _ in range(STEPS)]
    ys = [torch.randn(B, D, device="cuda") for _ in range(STEPS)]

    ref = reference(init, xs, ys)
    torch.cuda.synchronize()

    params = [p.clone().requires_grad_() for p in init]
    opt = CPUOffloadOptimizer(params)
    for x, y in zip(xs, ys):
        torch.cuda._sleep(SPIN)  # long forward/backward ahead in the compute stream
        grads = torch.autograd.grad(loss_fn(params, x, y), params)
        opt.offload_grads(grads)
        del grads
        opt.step()
    torch.cuda.synchronize()

    checksum = sum(m.double().sum().item() for m in opt.master)
    err = max((m - r).abs().max().item() for m, r in zip(opt.master, ref))
    print(f"checksum={checksum:.8e} max_err_vs_ref={err:.3e}",
          "OK" if err < 1e-6 else "MISMATCH")


if __name__ == "__main__":
    main()
