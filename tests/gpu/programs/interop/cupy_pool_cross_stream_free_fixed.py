# Source: plausible pattern (pure CuPy copy/compute overlap: uploads on an H2D stream,
# processing on a compute stream).  CuPy's device memory pool is stream-ordered per
# stream (cupy/cuda/memory.pyx SingleDeviceMemoryPool keeps separate free lists per
# stream): a block freed by an array that was allocated on stream A is handed out again
# immediately to the next allocation on stream A, with no event - CuPy has no
# equivalent of torch's record_stream.  Here `x` is allocated (and filled) on h2d_stream
# but read on compute_stream; it is dropped when process() returns, while compute_stream
# is still queued behind earlier work.  The next process() call allocates a same-sized
# array on h2d_stream, gets the same block and overwrites it with the next chunk's H2D
# copy before compute_stream has read the previous chunk (memory-reuse race:
# compute_stream kernel read vs h2d_stream memcpy write to the recycled block).
# Fix (_fixed.py): before `x` is released, make h2d_stream wait for an event recorded on
# compute_stream after the last kernel that reads `x`.
import numpy
import cupy
import cupyx

N = 1 << 21
ITERS = 12
WEIGHT = 0.75
SPIN_CYCLES = 30_000_000  # ~15 ms: compute stream busy with earlier work

_SPIN = cupy.RawKernel(r'''
extern "C" __global__ void spin_cycles(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
''', 'spin_cycles')


def gpu_spin(cycles):
    """Busy-wait on CuPy's current stream."""
    _SPIN((1,), (1,), (numpy.int64(cycles),))


class TwoStreamPipeline:
    def __init__(self):
        self.h2d_stream = cupy.cuda.Stream(non_blocking=True)
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)

    def process(self, host_chunk, busy=True):
        with self.h2d_stream:
            x = cupy.empty(host_chunk.shape, dtype=host_chunk.dtype)  # pool block owned by h2d_stream
            x.set(host_chunk, stream=self.h2d_stream)                 # async H2D (pinned source)
            uploaded = self.h2d_stream.record()
        self.compute_stream.wait_event(uploaded)
        with self.compute_stream:
            if busy:
                gpu_spin(SPIN_CYCLES)
            y = cupy.sqrt(cupy.abs(x)) * numpy.float32(WEIGHT)
            partial = y.sum(dtype=cupy.float64)
        # FIX: x goes back to h2d_stream's free list here, so order h2d_stream (the
        # stream that will reuse the block) after compute_stream's reads of x.
        self.h2d_stream.wait_event(self.compute_stream.record())
        return partial


def main():
    rng = numpy.random.default_rng(21)
    chunks = []
    for _ in range(ITERS):
        c = cupyx.empty_pinned((N,), dtype=numpy.float32)
        c[...] = rng.standard_normal(N, dtype=numpy.float32)
        chunks.append(c)

    pipe = TwoStreamPipeline()
    # warm-up (kernel compilation), host-synchronised
    pipe.process(chunks[0], busy=False)
    gpu_spin(1)
    cupy.cuda.Device(0).synchronize()

    partials = [pipe.process(c) for c in chunks]

    cupy.cuda.Device(0).synchronize()
    checksum = sum(float(p) for p in partials)
    ref = sum(float(numpy.sum(numpy.sqrt(numpy.abs(c)) * numpy.float32(WEIGHT),
                              dtype=numpy.float64)) for c in chunks)
    ok = abs(checksum - ref) <= 1e-6 * max(1.0, abs(ref))
    print(f'checksum={checksum:.6f} reference={ref:.6f} match={ok}')


if __name__ == '__main__':
    main()
