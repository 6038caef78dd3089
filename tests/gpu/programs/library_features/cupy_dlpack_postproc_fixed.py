# Source: plausible pattern built on real interop semantics. cupy.from_dlpack()
# passes CuPy's current stream to torch.Tensor.__dlpack__(stream=...), and torch then
# records an event on its current stream and makes that stream wait on it
# (torch/_tensor.py __dlpack__; cupy/_core/dlpack.pyx from_dlpack). That handshake
# only orders work enqueued BEFORE the export. Caching the zero-copy CuPy views
# once at init (to avoid per-call export overhead) loses the per-call ordering.
# Related: CuPy/DLPack docs ("the user is responsible to ensure the Producer and
# the Consumer are operating on the same stream"), huggingface/diffusers PR #13502.
# FIX: before each launch the CuPy stream (seen from torch as an ExternalStream)
# waits for torch's current stream, ordering the staging write before the kernel.
# (Re-exporting the views with cp.from_dlpack inside `with self.stream:` on every
# call would give the same edge through the DLPack handshake.)
import cupy as cp
import numpy as np
import torch
import torch.nn as nn

DEV = torch.device("cuda", 0)

_soft_threshold = cp.ElementwiseKernel(
    "float32 x, float32 scale, float32 thresh",
    "float32 y",
    "float a = fabsf(x) - thresh; y = a > 0.0f ? copysignf(a, x) * scale : 0.0f",
    "blind_soft_threshold",
)


class CupyPostProcessor:
    """Zero-copy post-processing of torch activations with a CuPy kernel."""

    def __init__(self, rows: int, cols: int):
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.torch_view_of_stream = torch.cuda.ExternalStream(self.stream.ptr, device=DEV)
        self.inp = torch.empty(rows, cols, device=DEV)
        self.out = torch.empty(rows, cols, device=DEV)
        with self.stream:
            # one-time zero-copy export; the DLPack handshake orders only what
            # torch enqueued so far
            self.inp_cp = cp.from_dlpack(self.inp)
            self.out_cp = cp.from_dlpack(self.out)

    def __call__(self, h: torch.Tensor, scale: float, thresh: float) -> torch.Tensor:
        self.inp.copy_(h)                                  # torch stream writes inp
        self.torch_view_of_stream.wait_stream(torch.cuda.current_stream())
        with self.stream:
            _soft_threshold(self.inp_cp, np.float32(scale), np.float32(thresh), self.out_cp)
        torch.cuda.current_stream().wait_stream(self.torch_view_of_stream)
        return self.out


def main():
    torch.manual_seed(0)
    post = CupyPostProcessor(2048, 1024)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()).to(DEV)
    torch.cuda.synchronize()
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(2048, 1024, device=DEV)
            h = model(x)
            y = post(h, scale=2.0, thresh=0.25)
            nnz = (y != 0).sum().item()
            print(f"step {step}: nonzero {nnz}")


if __name__ == "__main__":
    main()
