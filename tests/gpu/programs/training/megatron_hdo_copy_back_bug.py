# Megatron-LM HybridDeviceOptimizer (optimizer-state offload to CPU, overlapped D2H/H2D) (BUG version).
# Source: NVIDIA/Megatron-LM PR #1543 "param_copy_back_gpu_hook should sync to h2d stream"
#   (fixed by commit ae67076); file megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py.
#   After a CPU sub-optimizer steps, its post-step hook copies the updated (pinned) CPU params back
#   into the GPU params on _h2d_stream, then makes the current stream wait on an event.  The buggy
#   hook recorded that event on _d2h_stream instead of _h2d_stream, so nothing orders the H2D copy
#   before the next forward (GPU side) or before the next CPU optimizer step (host side).
import torch
import torch.nn as nn

DEV = torch.device("cuda:0")


def _param_generator(cpu_optimizer):
    for group in cpu_optimizer.param_groups:
        for param in group["params"]:
            yield param


class HybridDeviceOptimizer:
    def __init__(self, params, offload_fraction=0.5, lr=1e-3):
        params = list(params)
        offload_threshold = sum(p.numel() for p in params) * offload_fraction
        self.gpu_params_map_cpu_copy, self.cpu_copys_map_gpu_param = {}, {}
        cpu_params, gpu_params, offload_params_numel = [], [], 0
        for param in params:
            if offload_params_numel < offload_threshold:
                cpu_copy = param.detach().clone().cpu().pin_memory()
                offload_params_numel += param.numel()
                self.gpu_params_map_cpu_copy[param] = cpu_copy
                self.cpu_copys_map_gpu_param[cpu_copy] = param
                cpu_params.append(cpu_copy)
            else:
                gpu_params.append(param)
        # overlap_cpu_optimizer_d2h_h2d: one CPU optimizer per offloaded parameter
        self.cpu_optimizers = [torch.optim.Adam([p], lr=lr) for p in cpu_params]
        self.gpu_optimizer = torch.optim.Adam(gpu_params, lr=lr) if gpu_params else None
        self.cpu_copy_map_grad = {}
        self._d2h_stream = torch.cuda.Stream()
        self._h2d_stream = torch.cuda.Stream()
        self._cpu_optimizer_map_data_event = {}
        for optimizer in self.cpu_optimizers:
            optimizer.register_step_post_hook(self._param_copy_back_gpu_hook)

    def _param_copy_back_gpu_hook(self, optimizer, args, kwargs):
        self._h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._h2d_stream):
            for param in _param_generator(optimizer):
                gpu_param = self.cpu_copys_map_gpu_param[param]
                gpu_param.data.copy_(param.data, non_blocking=True)
        self._d2h_stream.record_event().wait(torch.cuda.current_stream())

    def _set_sub_optimizer_grads(self):
        # Sync the grads from GPU to CPU (runs on _d2h_stream).
        for optimizer in self.cpu_optimizers:
            for param in _param_generator(optimizer):
                gpu_param = self.cpu_copys_map_gpu_param[param]
                if param not in self.cpu_copy_map_grad:
                    self.cpu_copy_map_grad[param] = torch.empty(
                        param.shape, dtype=param.dtype, pin_memory=True, device="cpu")
                param.grad = self.cpu_copy_map_grad[param]
                self.cpu_copy_map_grad[param].data.copy_(gpu_param.grad, non_blocking=True)
            self._cpu_optimizer_map_data_event[optimizer] = self._d2h_stream.record_event()

    def step(self):
        self._d2h_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._d2h_stream):
            self._set_sub_optimizer_grads()
        if self.gpu_optimizer is not None:
            self.gpu_optimizer.step()
        for cpu_optimizer in self.cpu_optimizers:
            d2h_event = self._cpu_optimizer_map_data_event.pop(cpu_optimizer, None)
            if d2h_event is not None:
                d2h_event.synchronize()
            cpu_optimizer.step()

    def zero_grad(self, model):
        for p in model.parameters():
            p.grad = None


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 256)
        self.head = nn.Linear(256, 1)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        x = torch.relu(self.fc3(x))
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = MLP().to(DEV)
    # offload_fraction 0.5 -> fc1.weight, fc1.bias, fc2.weight are updated by CPU Adam
    optimizer = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
    losses = []
    for step in range(5):
        x = torch.randn(128, 256, device=DEV)
        y = torch.randn(128, 1, device=DEV)
        optimizer.zero_grad(model)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    print("losses", [round(v.item(), 4) for v in losses])


if __name__ == "__main__":
    main()
