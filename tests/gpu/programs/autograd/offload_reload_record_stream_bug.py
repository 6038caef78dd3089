# Source: NVIDIA Megatron-LM megatron/core/pipeline_parallel/cpu_offload.py (ChunkOffloadHandler:
#         bulk_offload_group copies activations to pinned CPU on d2h_stream and calls
#         tensor_on_device.record_stream(d2h_stream); bulk_reload_group re-creates them with
#         cpu_backup.to(dev, non_blocking=True) under h2d_stream, and backward_sync only makes the
#         compute stream wait for the h2d event - the reloaded tensors are never recorded on it).
# Pattern: saved_tensors_hooks offloader with dedicated D2H / H2D streams. The reloaded activation
# is allocated from the H2D stream's pool but consumed (and freed) by backward kernels on the
# compute stream.
import torch
from torch.autograd.graph import saved_tensors_hooks

SLEEP = 20_000_000
dev = torch.device("cuda")
torch.manual_seed(0)


class AsyncCpuOffload(saved_tensors_hooks):
    def __init__(self):
        self.d2h_stream = torch.cuda.Stream()
        self.h2d_stream = torch.cuda.Stream()
        super().__init__(self.on_save, self.on_load)

    def on_save(self, t):
        if t.requires_grad and t.grad_fn is None:  # parameters are not offloaded
            return t
        cur = torch.cuda.current_stream()
        self.d2h_stream.wait_stream(cur)  # t has been produced
        cpu_backup = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.d2h_stream):
            cpu_backup.copy_(t, non_blocking=True)
            offloaded = self.d2h_stream.record_event()
        t.record_stream(self.d2h_stream)  # t may be freed on the compute stream before the D2H ran
        return (t.device, cpu_backup, offloaded)

    def on_load(self, state):
        if isinstance(state, torch.Tensor):
            return state
        device, cpu_backup, offloaded = state
        cur = torch.cuda.current_stream()
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(offloaded)  # the CPU copy is complete
            reloaded = cpu_backup.to(device, non_blocking=True)  # block comes from h2d_stream's pool
            ready = self.h2d_stream.record_event()
        cur.wait_event(ready)
        torch.cuda._sleep(SLEEP)  # stands in for dgrad kernels queued ahead of the consumer
        return reloaded


def mlp(x, weights):
    for w in weights:
        x = torch.tanh(x @ w)
    return x


B, D, L = 2048, 1024, 3
weights = [(torch.randn(D, D, device=dev) / D**0.5).requires_grad_() for _ in range(L)]
x = torch.randn(B, D, device=dev)

with AsyncCpuOffload():
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
