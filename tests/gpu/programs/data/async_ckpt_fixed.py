# Case async_ckpt (FIXED version)
# Modeled on pytorch/pytorch torch/distributed/checkpoint/staging.py (DefaultStager /
# AsyncStager.synchronize_staging contract). Fix: before the optimizer mutates the
# parameters, the compute stream waits (cudaStreamWaitEvent, no host block) on the
# event recorded on the staging stream after the D2H copies, so forward/backward of the
# next step still overlap with staging and only the in-place update is ordered after it.
import io

import torch
import torch.nn as nn
import torch.nn.functional as F


class PinnedStager:
    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.cache = None
        self.staged = None

    def stage(self, state_dict):
        if self.cache is None:
            self.cache = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                          for k, v in state_dict.items()}
        # the copies must observe the optimizer update that produced these values
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for k, v in state_dict.items():
                self.cache[k].copy_(v, non_blocking=True)
        self.staged = torch.cuda.Event()
        self.staged.record(self.stream)
        return self.cache, self.staged

    def synchronize_staging(self):
        """GPU-side wait: the compute stream waits for the staging copies."""
        if self.staged is not None:
            torch.cuda.current_stream().wait_event(self.staged)


class CheckpointWriter:
    """Stands in for the background writer thread/process."""

    def __init__(self):
        self.pending = None
        self.written = {}

    def submit(self, step, staged, event):
        self.pending = (step, staged, event)

    def flush(self):
        if self.pending is None:
            return
        step, staged, event = self.pending
        event.synchronize()  # the D2H copies have landed in pinned memory
        buf = io.BytesIO()
        torch.save(staged, buf)
        self.written[step] = buf.getbuffer().nbytes
        self.pending = None


class MLP(nn.Module):
    def __init__(self, d=1024, depth=4):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def train_step(model, optimizer, stager, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    stager.synchronize_staging()  # FIX: params are read by in-flight staging copies
    optimizer.step()
    return loss.detach()


def main():
    torch.manual_seed(0)
    device = torch.device('cuda', 0)
    model = MLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    stager, writer = PinnedStager(), CheckpointWriter()
    g = torch.Generator(device=device).manual_seed(0)
    data = [(torch.randn(512, 1024, device=device, generator=g),
             torch.randn(512, 1024, device=device, generator=g)) for _ in range(4)]
    losses = []
    for step in range(12):
        x, y = data[step % len(data)]
        losses.append(train_step(model, optimizer, stager, x, y))
        if step % 3 == 0:
            writer.flush()  # previous checkpoint is on "disk" before its buffers are reused
            staged, event = stager.stage(model.state_dict())
            writer.submit(step, staged, event)
    writer.flush()
    print('checkpoints', sorted(writer.written), 'last loss', losses[-1].item())


if __name__ == '__main__':
    main()
