# Source: modelled on torchao's CPUOffloadOptimizer
# (pytorch/ao torchao/prototype/low_bit_optim/cpu_offload.py, PR #584): a
# register_post_accumulate_grad_hook copies each gradient D2H into a pinned CPU
# buffer on a side stream, records an event, and step() runs the optimizer on CPU
# and copies the parameter back H2D. In the real code step() calls
# `grad_d2h_event.synchronize()` before the CPU optimizer reads the pinned grad.
# (Related real bugs: PR #584 review, missing d2h_stream.wait_stream(current); the
# fairscale PR #496 CPU-offload grad transfer race.)
# BUG: step() drops the per-parameter event synchronize, so the CPU optimizer
# reads the pinned gradient while the D2H copy may still be writing it.
import torch
import torch.nn as nn

DEV = torch.device("cuda", 0)


class CPUOffloadOptimizer:
    def __init__(self, params, optimizer_class=torch.optim.AdamW, **kwargs):
        self.stream = torch.cuda.Stream(device=DEV)
        self.param_d2h_map = {}
        self.optim_dict = {}
        self.queue = {}   # insertion order == order in which grads became ready
        for p_device in params:
            if not p_device.requires_grad:
                continue
            p_host = torch.empty_like(p_device, device="cpu", pin_memory=True)
            p_host.grad = torch.empty_like(p_host, pin_memory=True)
            p_host.copy_(p_device.detach(), non_blocking=True)
            self.param_d2h_map[p_device] = p_host
            p_device.register_post_accumulate_grad_hook(self._backward_hook)
            self.optim_dict[p_device] = optimizer_class([p_host], **kwargs)

    def _backward_hook(self, p_device):
        if p_device.grad is None:
            return
        p_host = self.param_d2h_map[p_device]
        # make sure backward for this param finished
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            p_host.grad.copy_(p_device.grad, non_blocking=True)
        if p_device in self.queue:
            del self.queue[p_device]
        self.queue[p_device] = self.stream.record_event()

    @torch.no_grad()
    def step(self):
        for p_device, grad_d2h_event in self.queue.items():
            self.optim_dict[p_device].step()          # CPU AdamW reads p_host.grad
            p_host = self.param_d2h_map[p_device]
            with torch.cuda.stream(self.stream):
                p_device.copy_(p_host, non_blocking=True)
        # make sure param H2D finishes before the next forward pass
        self.stream.synchronize()
        self.queue.clear()

    def zero_grad(self):
        for p_device in self.param_d2h_map:
            p_device.grad = None


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).to(DEV)
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3, fused=True)
    for step in range(3):
        x = torch.randn(256, 512, device=DEV)
        loss = model(x).pow(2).mean()
        loss.backward()
        print(f"step {step}: loss {loss.item():.4f}")   # logging syncs the compute stream only
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
