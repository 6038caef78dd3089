# Source: torch/autograd/graph.py, save_on_cpu (pack: copy the activation to CPU; unpack:
#         packed.to(device, non_blocking=pin_memory)) and the PyTorch tutorial "A guide on good usage of
#         non_blocking and pin_memory()" (intermediate/pinmem_nonblock: a pinned source must not be
#         modified until the non_blocking copy has run).
# Pattern: to save page-locked memory the offloader keeps activations in pageable CPU memory and stages
# every reload through ONE reusable pinned buffer, then issues a non_blocking H2D copy from it.
import torch
from torch.autograd.graph import saved_tensors_hooks

SLEEP = 20_000_000
dev = torch.device("cuda")
torch.manual_seed(0)


class StagedCpuOffload(saved_tensors_hooks):
    def __init__(self, max_numel):
        self.staging = torch.empty(max_numel, pin_memory=True)
        self.h2d_done = torch.cuda.Event()
        super().__init__(self.pack, self.unpack)

    def pack(self, t):
        if t.requires_grad and t.grad_fn is None:  # parameters stay on the GPU
            return t
        return (t.device, t.detach().cpu())  # blocking D2H into pageable memory

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, cpu = packed
        # FIX: the previous non_blocking H2D may still be reading the staging buffer; wait for it on the host.
        self.h2d_done.synchronize()
        stage = self.staging[: cpu.numel()].view_as(cpu)
        stage.copy_(cpu)  # host memcpy into the shared pinned staging buffer
        torch.cuda._sleep(SLEEP)  # stands in for backward kernels already queued on this stream
        gpu = stage.to(device, non_blocking=True)  # the DMA reads `stage` only when the stream gets here
        self.h2d_done.record()
        return gpu


def mlp(x, weights):
    for w in weights:
        x = torch.tanh(x @ w)
    return x


B, D, L = 2048, 1024, 3
weights = [(torch.randn(D, D, device=dev) / D**0.5).requires_grad_() for _ in range(L)]
x = torch.randn(B, D, device=dev)

with StagedCpuOffload(B * D):
    loss = mlp(x, weights).pow(2).mean()
loss.backward()
torch.cuda.synchronize()
checksum = sum(w.grad.double().abs().sum().item() for w in weights)

# Reference: same model without offloading.
ref_w = [w.detach().clone().requires_grad_() for w in weights]
mlp(x, ref_w).pow(2).mean().backward()
reference = sum(w.grad.double().abs().sum().item() for w in ref_w)

torch.cuda.synchronize()
match = abs(checksum - reference) <= 1e-4 * abs(reference) + 1e-6
print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")
