# Source: cuSignal-style streaming spectrum analyser (plausible pattern modelled on the
# cuSignal / cupyx.scipy.signal online-processing examples: the radio receive loop fills
# pinned staging buffers that are uploaded with ndarray.set(stream=copy_stream) and
# FFT'd on a compute stream, double-buffered).  The device-side edges are all present
# (copy -> compute via `uploaded[b]`, and compute -> next upload into the same device
# buffer via `compute_done[b]`), but the host refills pinned staging buffer b for block
# i+2 without waiting for the asynchronous H2D copy that was issued from it for block i.
# Because copy_stream's upload of block i is itself held back behind the FFT of block
# i-2, the host write usually lands before the DMA reads the buffer.
# Race (host-device): host numpy write into self.staging[b] vs the cudaMemcpyAsync
# (dev[b].set(staging[b], stream=copy_stream)) still reading it.
# (FFTs run on a single compute stream on purpose: cupy/cupy#8079, the cuFFT plan
# cache is not stream-safe.)
# Fix (_fixed.py): synchronize on uploaded[b] before the host overwrites staging[b].
import numpy
import cupy
import cupyx

BATCH = 256
NFFT = 4096
BLOCKS = 16
SPIN_CYCLES = 30_000_000  # ~15 ms per block: channeliser/detector work on the compute stream

_SPIN = cupy.RawKernel(r'''
extern "C" __global__ void spin_cycles(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
''', 'spin_cycles')


def gpu_spin(cycles):
    """Busy-wait on CuPy's current stream."""
    _SPIN((1,), (1,), (numpy.int64(cycles),))


class SpectrumAnalyzer:
    def __init__(self):
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)
        self.staging = [cupyx.empty_pinned((BATCH, NFFT), dtype=numpy.complex64)
                        for _ in range(2)]
        with self.compute_stream:
            self.dev = [cupy.empty((BATCH, NFFT), dtype=cupy.complex64) for _ in range(2)]
            self.window = cupy.asarray(numpy.hanning(NFFT).astype(numpy.float32))
            self.psd = cupy.zeros(NFFT, dtype=cupy.float64)
        self.compute_stream.synchronize()
        self.uploaded = [None, None]
        self.compute_done = [None, None]
        self.count = 0

    def push(self, block, busy=True):
        b = self.count % 2
        self.count += 1
        # FIX: wait until the H2D copy issued from staging[b] two blocks ago has completed.
        if self.uploaded[b] is not None:
            self.uploaded[b].synchronize()
        self.staging[b][...] = block                       # receive thread writes samples
        if self.compute_done[b] is not None:
            self.copy_stream.wait_event(self.compute_done[b])  # dev[b] no longer read
        self.dev[b].set(self.staging[b], stream=self.copy_stream)
        self.uploaded[b] = self.copy_stream.record()
        self.compute_stream.wait_event(self.uploaded[b])
        with self.compute_stream:
            if busy:
                gpu_spin(SPIN_CYCLES)
            spec = cupy.fft.fft(self.dev[b] * self.window, axis=1)
            self.psd += (spec.real ** 2 + spec.imag ** 2).sum(axis=0)
        self.compute_done[b] = self.compute_stream.record()


def main():
    rng = numpy.random.default_rng(99)
    blocks = [(rng.standard_normal((BATCH, NFFT), dtype=numpy.float32)
               + 1j * rng.standard_normal((BATCH, NFFT), dtype=numpy.float32))
              .astype(numpy.complex64) for _ in range(BLOCKS)]

    ana = SpectrumAnalyzer()
    # warm-up: cuFFT plan, kernels (host-synchronised), then reset the accumulator
    ana.push(blocks[0], busy=False)
    gpu_spin(1)
    cupy.cuda.Device(0).synchronize()
    ana.psd.fill(0)
    cupy.cuda.Device(0).synchronize()

    for blk in blocks:
        ana.push(blk)

    cupy.cuda.Device(0).synchronize()
    psd = ana.psd.get()
    checksum = float(psd.sum())
    win = numpy.hanning(NFFT).astype(numpy.float32)
    ref_psd = numpy.zeros(NFFT, dtype=numpy.float64)
    for blk in blocks:
        spec = numpy.fft.fft(blk * win, axis=1)
        ref_psd += (spec.real ** 2 + spec.imag ** 2).sum(axis=0)
    ref = float(ref_psd.sum())
    err = float(numpy.max(numpy.abs(psd - ref_psd)) / numpy.max(ref_psd))
    ok = err <= 1e-3
    print(f'checksum={checksum:.3f} reference={ref:.3f} max_rel_err={err:.2e} match={ok}')


if __name__ == '__main__':
    main()
