# Source: facebookresearch/fairscale PR #729 (FSDP move_grads_to_cpu: `param._cpu_grad.copy_(
#   param.grad.data, non_blocking=True)`; myleott reports results that differed from the
#   non_blocking=False run, "This suggests a missing stream synchronization", to be fixed by an
#   extra torch.cuda.synchronize() in fairseq's cpu_adam.py) and pytorch/pytorch PR #98667 (FSDP
#   optimizer overlap: "non_blocking=True won't work since the copy may have not finished before
#   the optimizer step executes on CPU").
# Pattern: ZeRO-Offload-style step. Gradients are copied GPU->pinned host with non_blocking=True,
#   an event marks the end of those copies, the next micro-batch's forward is queued behind them
#   (delayed parameter update: it still uses the current weights), and a NumPy Adam updates the
#   fp32 master weights on the host, which are then uploaded back to the GPU.
import copy

import numpy as np
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DEV = torch.device("cuda", 0)
DIM, ROWS, LAYERS = 1024, 512, 3
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


class NumpyAdam:
    """Host Adam over flat fp32 arrays (what DeepSpeed's / fairseq's cpu_adam does in C++)."""

    def __init__(self, masters):
        self.masters = masters
        self.m = [np.zeros_like(p) for p in masters]
        self.v = [np.zeros_like(p) for p in masters]
        self.t = 0

    def step(self, grads):
        self.t += 1
        b1, b2 = BETAS
        for p, g, m, v in zip(self.masters, grads, self.m, self.v):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            m_hat = m / (1 - b1 ** self.t)
            v_hat = v / (1 - b2 ** self.t)
            p -= LR * m_hat / (np.sqrt(v_hat) + EPS)


class GradOffloader:
    """Pinned landing buffers for the gradients of `params` (GPU -> host, non_blocking)."""

    def __init__(self, params):
        self.params = params
        self.buffers = [torch.zeros(p.shape, pin_memory=True) for p in params]
        self.landed = None

    def start(self):
        for buf, p in zip(self.buffers, self.params):
            buf.copy_(p.grad, non_blocking=True)
        self.landed = torch.cuda.current_stream().record_event()

    def host_views(self):
        # FIX: block the host until the non_blocking D2H gradient copies have landed
        self.landed.synchronize()
        return [buf.numpy() for buf in self.buffers]


def build_model():
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(DIM, DIM, bias=False), nn.GELU()]
    return nn.Sequential(*layers).to(DEV)


def main():
    torch.manual_seed(0)
    model = build_model()
    ref_model = copy.deepcopy(model)
    x, x_next = torch.randn(ROWS, DIM, device=DEV), torch.randn(ROWS, DIM, device=DEV)
    params = list(model.parameters())

    # reference: same step with fully synchronous copies
    ref_model(x).sum().backward()
    torch.cuda.synchronize()
    ref_adam = NumpyAdam([p.detach().cpu().numpy().copy() for p in ref_model.parameters()])
    ref_adam.step([p.grad.cpu().numpy() for p in ref_model.parameters()])

    # offload state: pinned fp32 master weights and pinned gradient landing buffers
    master = [torch.empty(p.shape, pin_memory=True) for p in params]
    for mp, p in zip(master, params):
        mp.copy_(p.detach())  # blocking D2H
    offloader = GradOffloader(params)
    adam = NumpyAdam([mp.numpy() for mp in master])

    model(x).sum().backward()
    torch.cuda._sleep(SLEEP_CYCLES)  # the tail of backward is still running on the GPU
    offloader.start()
    with torch.no_grad():
        next_out = model(x_next)  # overlapped forward of the next micro-batch (old weights)

    adam.step(offloader.host_views())

    with torch.no_grad():
        for p, mp in zip(params, master):
            p.copy_(mp)  # blocking H2D upload of the updated weights

    torch.cuda.synchronize()
    weights = [p.detach().cpu() for p in params]
    expected = [torch.from_numpy(a) for a in ref_adam.masters]
    checksum = sum(w.double().sum().item() for w in weights)
    reference = sum(e.double().sum().item() for e in expected)
    ok = all(torch.allclose(w, e, rtol=1e-4, atol=1e-6) for w, e in zip(weights, expected))
    ok = ok and bool(torch.isfinite(next_out).all())
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={ok}")


if __name__ == "__main__":
    main()
