# Source: modelled on torchtune's OffloadActivations
# (torchtune/training/_activation_offloading.py: saved_tensors_hooks, pinned CPU
# copies on a side stream s1, an event to sync back) and on the bug reported in
# NVIDIA/Megatron-LM#7398 ("the inline reload in tensor_pop races its own D2H"):
# the reload H2D copy is enqueued on the compute stream with no ordering edge on
# the offload event recorded on the D2H stream, so it can read the pinned staging
# buffer while the D2H copy that fills it is still in flight.
# BUG: unpack() never waits on the D2H event before reading the pinned buffer.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

DEV = torch.device("cuda", 0)


class OffloadActivations(saved_tensors_hooks):
    """Offload large saved activations to pinned CPU memory on a D2H stream."""

    def __init__(self, model: nn.Module, min_offload_bytes: int = 1 << 20):
        self.d2h_stream = torch.cuda.Stream(device=DEV)
        self.min_offload_bytes = min_offload_bytes
        # never offload parameters (or views of them, e.g. weight.t() saved by addmm)
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        super().__init__(self.pack, self.unpack)

    def _should_offload(self, t: torch.Tensor) -> bool:
        return (t.is_cuda
                and t.numel() * t.element_size() >= self.min_offload_bytes
                and t.untyped_storage().data_ptr() not in self.param_storages)

    def pack(self, activation: torch.Tensor):
        if not self._should_offload(activation):
            return activation
        compute = torch.cuda.current_stream()
        self.d2h_stream.wait_stream(compute)           # activation is fully written
        with torch.cuda.stream(self.d2h_stream):
            cpu = torch.empty(activation.size(), dtype=activation.dtype,
                              layout=activation.layout, pin_memory=True)
            cpu.copy_(activation, non_blocking=True)
        activation.record_stream(self.d2h_stream)      # GPU copy may be freed early
        event = torch.cuda.Event()
        event.record(self.d2h_stream)
        return (activation.device, cpu, event)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, cpu, event = packed
        # reload inline on the compute stream
        return cpu.to(device, non_blocking=True)


class Block(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def main():
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(512, 2048) for _ in range(3)]).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    offload = OffloadActivations(model)
    torch.cuda.synchronize()
    for step in range(3):
        x = torch.randn(1024, 512, device=DEV)
        with offload:
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
