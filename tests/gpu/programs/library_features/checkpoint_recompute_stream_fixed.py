# Source: plausible pattern built on the real torch.utils.checkpoint API: the
# non-reentrant checkpoint takes `context_fn` returning (forward_ctx, recompute_ctx)
# and enters recompute_ctx around the recomputed forward (torch/utils/checkpoint.py,
# recompute_fn). Here recompute_ctx moves the recomputation onto a dedicated stream.
# Related real bug class: huggingface/trl PR #7195 ("under ... checkpoint recompute
# ... the actual current stream at pack/unpack time can differ").
# FIX: on entry the recompute stream waits for the caller stream
# (self.stream.wait_stream(self.caller)), which (transitively) orders the forward's
# write of the checkpoint input before the recomputation reads it.
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEV = torch.device("cuda", 0)


class RecomputeOnStream:
    """Context manager used as checkpoint's recompute context."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def __enter__(self):
        self.caller = torch.cuda.current_stream()
        self.stream.wait_stream(self.caller)
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        # backward nodes on the caller stream consume the recomputed activations
        self.caller.wait_stream(self.stream)
        return False


class MLPBlock(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d=1024, hidden=4096, n_out=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.block = MLPBlock(d, hidden)
        self.head = nn.Linear(d, n_out)
        self.recompute_stream = torch.cuda.Stream(device=DEV)

    def _checkpoint_contexts(self):
        return nullcontext(), RecomputeOnStream(self.recompute_stream)

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=False,
                       context_fn=self._checkpoint_contexts)
        return self.head(h)


def main():
    torch.manual_seed(0)
    model = Net().to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    for step in range(3):
        x = torch.randn(1024, 1024, device=DEV)
        target = torch.randn(1024, 16, device=DEV)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
