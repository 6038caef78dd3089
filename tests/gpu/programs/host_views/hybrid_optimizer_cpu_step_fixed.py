# Source: megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py, HybridDeviceOptimizer (offload_fraction=1.0,
#   overlap_cpu_optimizer_d2h_h2d=True, pin_cpu_grads/pin_cpu_params=True): step() runs _set_sub_optimizer_grads()
#   on _d2h_stream (cpu_copy_map_grad[param].data.copy_(grad, non_blocking=True), then
#   _cpu_optimizer_map_data_event[optimizer] = _d2h_stream.record_event()), waits d2h_event.synchronize() and runs
#   the per-parameter CPU torch.optim.AdamW; the step post-hook copies the CPU params back on _h2d_stream.
#   Megatron's timers call torch.cuda.synchronize() at iteration boundaries.
# Bug: the d2h_event.synchronize() before cpu_optimizer.step() is dropped ("the D2H is overlapped anyway"). The CPU
#   AdamW kernels (torch CPU ops on the host) read the pinned gradient buffers cpu_copy_map_grad[param] while the
#   non_blocking D2H copies on _d2h_stream, queued behind the backward pass, still write them: host read vs
#   _d2h_stream write of the same pinned grads, no happens-before edge. The optimizer consumes stale gradients.
# Fix: restore d2h_event.synchronize() before each cpu_optimizer.step().
import time

import torch
import torch.nn as nn

HIDDEN, ITERS, LR = 256, 4, 1e-2


def _param_generator(cpu_optimizer):
    for group in cpu_optimizer.param_groups:
        for param in group["params"]:
            yield param


class _Timer:
    def __init__(self):
        self.elapsed = 0.0

    def start(self):
        torch.cuda.synchronize()
        self._t0 = time.time()

    def stop(self):
        torch.cuda.synchronize()
        self.elapsed += time.time() - self._t0


class HybridDeviceOptimizer:
    def __init__(self, params, lr):
        self.cpu_copys_map_gpu_param = {}
        self.cpu_optimizers = []
        for gpu_param in params:
            cpu_param = gpu_param.detach().clone().cpu().pin_memory()
            self.cpu_copys_map_gpu_param[cpu_param] = gpu_param
            opt = torch.optim.AdamW([cpu_param], lr=lr, weight_decay=0.01)  # build_cpu_optimizer_list
            opt.register_step_post_hook(self._param_copy_back_gpu_hook)
            self.cpu_optimizers.append(opt)
        self.cpu_copy_map_grad = {}
        self._d2h_stream = torch.cuda.Stream()
        self._h2d_stream = torch.cuda.Stream()
        self._cpu_optimizer_map_data_event = {}

    def _param_copy_back_gpu_hook(self, optimizer, args, kwargs):
        self._h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._h2d_stream):
            for param in _param_generator(optimizer):
                self.cpu_copys_map_gpu_param[param].data.copy_(param.data, non_blocking=True)
        self._h2d_stream.record_event().wait(torch.cuda.current_stream())

    def _set_sub_optimizer_grads(self):
        for optimizer in self.cpu_optimizers:
            for param in _param_generator(optimizer):
                grad = self.cpu_copys_map_gpu_param[param].grad
                param.requires_grad = False
                if param not in self.cpu_copy_map_grad:
                    self.cpu_copy_map_grad[param] = torch.empty(param.shape, dtype=param.dtype, pin_memory=True, device="cpu")
                param.grad = self.cpu_copy_map_grad[param]
                self.cpu_copy_map_grad[param].data.copy_(grad, non_blocking=True)
            self._cpu_optimizer_map_data_event[optimizer] = self._d2h_stream.record_event()

    def step(self):
        self._d2h_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._d2h_stream):
            self._set_sub_optimizer_grads()
        for cpu_optimizer in self.cpu_optimizers:
            d2h_event = self._cpu_optimizer_map_data_event.pop(cpu_optimizer, None)
            if d2h_event is not None:
                d2h_event.synchronize()
            cpu_optimizer.step()


def build_model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)).to(device)


def main():
    device = torch.device("cuda:0")
    torch.manual_seed(1)
    batches = [(torch.randn(128, HIDDEN, device=device), torch.randn(128, HIDDEN, device=device)) for _ in range(ITERS)]

    model = build_model(device)
    optimizer = HybridDeviceOptimizer(list(model.parameters()), LR)
    timer = _Timer()
    for x, y in batches:
        timer.start()
        model.zero_grad(set_to_none=True)
        torch.cuda._sleep(40_000_000)  # the forward of a real model keeps the default stream busy
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        timer.stop()

    # Reference: same model, same data, blocking D2H of the grads and the same CPU AdamW.
    ref_model = build_model(device)
    ref_cpu = [p.detach().cpu().clone() for p in ref_model.parameters()]
    ref_opts = [torch.optim.AdamW([p], lr=LR, weight_decay=0.01) for p in ref_cpu]
    for x, y in batches:
        ref_model.zero_grad(set_to_none=True)
        (ref_model(x) - y).pow(2).mean().backward()
        for p_cpu, p_gpu, opt in zip(ref_cpu, ref_model.parameters(), ref_opts):
            p_cpu.grad = p_gpu.grad.cpu()
            opt.step()
            p_gpu.data.copy_(p_cpu)
    torch.cuda.synchronize()
    match = all(torch.allclose(p.detach().cpu(), r, atol=1e-5, rtol=1e-4) for p, r in zip(model.parameters(), ref_cpu))
    print("iters=%d interval=%.3fs" % (ITERS, timer.elapsed))
    print("match=%s" % match)


if __name__ == "__main__":
    main()
