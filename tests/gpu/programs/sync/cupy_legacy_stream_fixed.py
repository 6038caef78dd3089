# cupy_legacy_stream (FIXED version)
# Source: CuPy preprocessing feeding a PyTorch model. NVIDIA/nvvl PR #69 (a
# stream made with cudaStreamCreate is implicitly ordered with PyTorch's legacy
# default stream; cudaStreamNonBlocking removes that), pytorch/pytorch issue
# #2702 / PR #3054 (PyTorch's pool streams are cudaStreamNonBlocking on purpose),
# cupy/cupy PR #3141 and torch.cuda.ExternalStream for sharing one stream.
# Semantics: PyTorch's default stream is the LEGACY default stream (handle 0).
# Work launched on it waits for prior work on every BLOCKING stream of the
# context (and later blocking-stream work waits for it); non-blocking streams,
# e.g. cupy.cuda.Stream(non_blocking=True) or torch.cuda.Stream(), get no such
# implicit ordering.
import cupy as cp
import torch

torch.manual_seed(0)
DEV = torch.device("cuda:0")
N, D, STEPS = 2048, 1024, 6

gated_relu = cp.ElementwiseKernel(
    "T x, T g", "T y", "y = x > (T)0 ? x * g : (T)0", "gated_relu")


class CupyPreprocessor:
    """CuPy feature kernel plus a torch op, both on one CuPy-created stream."""

    def __init__(self, gain):
        # FIX: a BLOCKING stream (CuPy's default flag): the model's kernels on the
        # legacy default stream implicitly wait for the work queued here.
        self.cp_stream = cp.cuda.Stream()
        self.t_stream = torch.cuda.ExternalStream(self.cp_stream.ptr)
        self.gain_cp = cp.asarray(gain)               # zero-copy view (CAI v2)

    def run(self, raw, feat):
        with self.cp_stream:
            gated_relu(cp.asarray(raw), self.gain_cp, cp.asarray(feat))
        with torch.cuda.stream(self.t_stream):
            feat.clamp_(max=4.0)                      # torch op on the same stream


def main():
    assert torch.cuda.current_stream().cuda_stream == 0   # legacy default stream
    raws = [torch.randn(N, D, device=DEV) for _ in range(STEPS)]
    feats = [torch.empty(N, D, device=DEV) for _ in range(STEPS)]
    gain = torch.rand(D, device=DEV) + 0.5
    model = torch.nn.Linear(D, 256).to(DEV)
    torch.cuda.synchronize()                          # inputs ready for any stream
    pre = CupyPreprocessor(gain)
    acc = torch.zeros(N, 256, device=DEV)
    with torch.no_grad():
        for step in range(STEPS):
            pre.run(raws[step], feats[step])
            acc += model(feats[step])                 # legacy default stream reads
    torch.cuda.synchronize()
    print("acc mean", acc.mean().item())


if __name__ == "__main__":
    main()
