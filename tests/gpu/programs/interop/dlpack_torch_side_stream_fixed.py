# Source: plausible pattern (torch -> CuPy hand-off through DLPack).  The stream
# hand-shake is the one implemented by pytorch torch/_tensor.py Tensor.__dlpack__(stream=...)
# and cupy/_core/dlpack.pyx from_dlpack(): CuPy passes its *current* stream as the
# consumer stream, and torch records an event on torch.cuda.current_stream() *at the
# time of the call* and makes the consumer wait on it.
# Race: the tensor `y` is produced by kernels enqueued on the preprocessing side stream
# (`with torch.cuda.stream(pre.stream)`), but cupy.from_dlpack(y) is called after the
# `with` block has been left, so torch's current stream is the default stream.  The
# CuPy scorer stream is therefore ordered after the default stream only, not after
# pre.stream, and the ElementwiseKernel on scorer.stream reads `y` while pre.stream may
# still be writing it (device-device read-after-write race).
# Fix (_fixed.py): call scorer.score_tensor(y) inside `with torch.cuda.stream(pre.stream)`.
import numpy
import torch
import cupy

N = 1 << 22
ITERS = 12
SPIN_CYCLES = 40_000_000  # ~20 ms of "heavy preprocessing" on the torch side stream


class Preprocessor:
    """torch-side producer: normalises a batch on its own side stream."""

    def __init__(self):
        self.stream = torch.cuda.Stream()

    @torch.no_grad()
    def __call__(self, x):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SPIN_CYCLES)  # stands in for decode/resize/augment kernels
            y = torch.tanh(x) * 0.5 + 0.25
        x.record_stream(self.stream)
        return y


_score = cupy.ElementwiseKernel(
    'float32 v, float32 w', 'float32 out',
    'out = v * w + v * v',
    'interop_score')


class CupyScorer:
    """CuPy-side consumer running on its own non-blocking stream."""

    def __init__(self, weights):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.w = cupy.asarray(weights)
        self.stream.synchronize()

    def score_tensor(self, t):
        with self.stream:
            v = cupy.from_dlpack(t)  # zero-copy; producer = torch's current stream
            s = cupy.sum(_score(v, self.w), dtype=cupy.float64)
        # keep t's block alive for our stream (torch allocator only knows pre.stream)
        t.record_stream(torch.cuda.ExternalStream(self.stream.ptr))
        return s


def main():
    rng = numpy.random.default_rng(1234)
    host = [rng.standard_normal(N, dtype=numpy.float32) for _ in range(ITERS)]
    weights = rng.standard_normal(N, dtype=numpy.float32)

    pre = Preprocessor()
    scorer = CupyScorer(weights)

    # warm-up (kernel compilation, allocator) outside the measured loop
    w = pre(torch.zeros(N, device='cuda'))
    torch.cuda.synchronize()
    scorer.score_tensor(w)
    torch.cuda.synchronize()
    del w

    scores = []
    for i in range(ITERS):
        x = torch.from_numpy(host[i]).cuda()
        y = pre(x)
        # FIX: export y while its producer stream is torch's current stream, so the
        # DLPack hand-shake makes scorer.stream wait for pre.stream.
        with torch.cuda.stream(pre.stream):
            scores.append(scorer.score_tensor(y))

    del x, y  # (freed while the scorer's stream lives: a tensor recorded on a destroyed stream aborts)
    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()

    checksum = sum(float(s) for s in scores)
    ref = 0.0
    for i in range(ITERS):
        yr = numpy.tanh(host[i]) * numpy.float32(0.5) + numpy.float32(0.25)
        ref += float(numpy.sum(yr * weights + yr * yr, dtype=numpy.float64))
    ok = abs(checksum - ref) <= 1e-6 * max(1.0, abs(ref))
    print(f'checksum={checksum:.6f} reference={ref:.6f} match={ok}')


if __name__ == '__main__':
    main()
