# Source: plausible pattern (torch model + CuPy RawKernel post-processing, zero-copy via
# __cuda_array_interface__).  pytorch torch/_tensor.py Tensor.__cuda_array_interface__
# exports CAI *version 2* with no 'stream' entry, so cupy.asarray(tensor) is a pure
# zero-copy view and establishes no stream ordering at all (unlike DLPack / CAI v3).
# Race: the logits are written by the torch Linear layer on torch's current (default)
# stream; the post-processor launches its RawKernel on its own non-blocking CuPy stream
# right away, so the kernel can read the logits before (or while) the GEMM writes them
# (device-device read-after-write race between torch default stream and CuPy stream).
# Fix (_fixed.py): make the CuPy stream wait for torch's current stream before the launch
# (torch.cuda.ExternalStream(self.stream.ptr).wait_stream(torch.cuda.current_stream())).
import numpy
import torch
import cupy

B = 8192         # detections per batch
D_IN = 256
C = 512          # classes
ITERS = 12
THRESH = 0.5
SPIN_CYCLES = 30_000_000  # ~15 ms: stands in for the backbone before the head

_COUNT_SRC = r'''
extern "C" __global__
void count_above(const float* logits, int* counts, float thresh, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int c = 0;
    for (int j = 0; j < cols; ++j)
        c += logits[(long long)r * cols + j] > thresh;
    counts[r] = c;
}
'''


class ThresholdCounter:
    """CuPy post-processing: per-row count of logits above a threshold."""

    def __init__(self, thresh):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.kernel = cupy.RawKernel(_COUNT_SRC, 'count_above')
        self.thresh = numpy.float32(thresh)

    def __call__(self, logits_t):
        rows, cols = logits_t.shape
        logits = cupy.asarray(logits_t)  # zero-copy view through __cuda_array_interface__
        # BUG: nothing orders torch's current stream (which produces logits_t) before
        # self.stream; CAI v2 carries no stream, so no implicit synchronisation either.
        with self.stream:
            counts = cupy.empty(rows, dtype=cupy.int32)
            self.kernel(((rows + 127) // 128,), (128,),
                        (logits, counts, self.thresh, numpy.int32(rows), numpy.int32(cols)))
            total = counts.sum(dtype=cupy.int64)
        # logits_t's block must not be recycled by torch before our kernel has read it
        logits_t.record_stream(torch.cuda.ExternalStream(self.stream.ptr))
        return total


def main():
    torch.manual_seed(0)
    rng = numpy.random.default_rng(42)
    host = [rng.standard_normal((B, D_IN), dtype=numpy.float32) for _ in range(ITERS)]

    head = torch.nn.Linear(D_IN, C).cuda().eval()
    post = ThresholdCounter(THRESH)

    # warm-up: compile the RawKernel and the reduction, initialise cuBLAS
    with torch.no_grad():
        w = head(torch.zeros(4, D_IN, device='cuda'))
    torch.cuda.synchronize()
    post(w)
    cupy.cuda.Device(0).synchronize()
    del w

    totals = []
    refs = []
    with torch.no_grad():
        for i in range(ITERS):
            x = torch.from_numpy(host[i]).cuda()
            torch.cuda._sleep(SPIN_CYCLES)
            logits = head(x)
            refs.append((logits > THRESH).sum())  # same stream as the producer: race-free
            totals.append(post(logits))
            del logits

    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()

    checksum = sum(int(t) for t in totals)
    ref = sum(int(r.item()) for r in refs)
    print(f'checksum={checksum} reference={ref} match={checksum == ref}')


if __name__ == '__main__':
    main()
