# Source: plausible pattern, no single upstream issue. A torch.library.custom_op
# (honest schema: mutates_args={"buf"}) whose implementation runs on a
# library-private "comm" stream instead of the caller's current stream. Bug class
# "custom op does not honour the caller's current stream", cf.
# graphdeco-inria/diff-gaussian-rasterization#60 and microsoft/onnxruntime#17412.
# The op stages an activation into a persistent, pre-registered communication
# buffer (as vLLM's custom all-reduce copies inputs into its registered buffer).
# FIX: the comm stream waits for the caller's stream before reading `x`
# (comm.wait_stream(caller)), in addition to the existing join back.
import torch
import torch.nn as nn
from torch import Tensor

DEV = torch.device("cuda", 0)

_COMM_STREAM = None


def _comm_stream() -> torch.cuda.Stream:
    global _COMM_STREAM
    if _COMM_STREAM is None:
        _COMM_STREAM = torch.cuda.Stream(device=DEV)
    return _COMM_STREAM


@torch.library.custom_op("blindlibs::stage_to_comm_buffer_", mutates_args={"buf"})
def stage_to_comm_buffer_(x: Tensor, scale: float, buf: Tensor) -> None:
    """Scale `x` and write it (as fp16) into the registered comm buffer `buf`."""
    caller = torch.cuda.current_stream(x.device)
    comm = _comm_stream()
    comm.wait_stream(caller)
    with torch.cuda.stream(comm):
        buf.copy_(x * scale)
    caller.wait_stream(comm)


@stage_to_comm_buffer_.register_fake
def _(x, scale, buf):
    return None


class CommBuffer:
    """Persistent staging buffer, allocated once (like an IPC-registered buffer)."""

    def __init__(self, numel: int):
        self.buf = torch.empty(numel, dtype=torch.float16, device=DEV)

    def stage(self, x: Tensor, world_size: int) -> Tensor:
        view = self.buf[: x.numel()].view(x.shape)
        stage_to_comm_buffer_(x, 1.0 / world_size, view)
        return view


class Encoder(nn.Module):
    def __init__(self, d: int = 1024, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def main():
    torch.manual_seed(0)
    comm = CommBuffer(4096 * 1024)
    model = Encoder().to(DEV)
    torch.cuda.synchronize()
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(2048, 1024, device=DEV)
            h = model(x)                      # producer: default stream writes h
            staged = comm.stage(h, world_size=2)
            total = staged.float().sum().item()
            print(f"step {step}: staged sum {total:.3f}")


if __name__ == "__main__":
    main()
