# Source: plausible pattern (GPU data-augmentation implemented with a CuPy ElementwiseKernel
# on its own stream, fed torch tensors through DLPack).  Same class of bug as the one that
# torch documents for Tensor.record_stream, but across libraries: cupy.from_dlpack(t)
# correctly orders torch's current stream before the CuPy stream, yet torch's caching
# allocator only knows that t's block belongs to the default stream.  The CuPy view is a
# local that dies when __call__ returns, and the caller drops t right after the call, so
# the block goes back to torch's pool immediately and the next torch.from_numpy(..).cuda()
# on the default stream reuses it and overwrites it while the augmentation kernel on the
# CuPy stream (still queued behind earlier work) has not read it yet
# (missing record_stream -> allocator reuse race: CuPy-stream read vs default-stream H2D write).
# Fix (_fixed.py): t.record_stream(torch.cuda.ExternalStream(self.stream.ptr)) after the launch.
import numpy
import torch
import cupy

N = 1 << 22
ITERS = 12
GAIN = 1.5
SPIN_CYCLES = 30_000_000  # ~15 ms: the augmenter is busy with earlier work

_SPIN = cupy.RawKernel(r'''
extern "C" __global__ void spin_cycles(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
''', 'spin_cycles')


def gpu_spin(cycles):
    """Busy-wait on CuPy's current stream."""
    _SPIN((1,), (1,), (numpy.int64(cycles),))


class CupyAugmenter:
    def __init__(self):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.kernel = cupy.ElementwiseKernel(
            'float32 x, float32 gain', 'float32 y',
            'y = gain * x + 0.1f * x * x',
            'interop_augment')

    def __call__(self, t, gain, busy=True):
        with self.stream:
            x = cupy.from_dlpack(t)  # orders torch's current stream before self.stream
            if busy:
                gpu_spin(SPIN_CYCLES)
            y = self.kernel(x, numpy.float32(gain))
            s = y.sum(dtype=cupy.float64)
        # BUG: torch's allocator is not told that self.stream still uses t's memory.
        return s


def main():
    rng = numpy.random.default_rng(3)
    host = [rng.standard_normal(N, dtype=numpy.float32) for _ in range(ITERS)]

    aug = CupyAugmenter()

    # warm-up (kernel compilation), host-synchronised
    w = torch.zeros(N, device='cuda')
    aug(w, GAIN, busy=False)
    gpu_spin(1)
    cupy.cuda.Device(0).synchronize()
    del w

    sums = []
    for i in range(ITERS):
        t = torch.from_numpy(host[i]).cuda()   # "decoded" batch on the default stream
        sums.append(aug(t, GAIN))
        del t                                  # free early to keep peak memory low

    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()

    checksum = sum(float(s) for s in sums)
    g = numpy.float32(GAIN)
    ref = sum(float(numpy.sum(g * h + numpy.float32(0.1) * h * h, dtype=numpy.float64))
              for h in host)
    ok = abs(checksum - ref) <= 1e-6 * max(1.0, abs(ref))
    print(f'checksum={checksum:.6f} reference={ref:.6f} match={ok}')


if __name__ == '__main__':
    main()
