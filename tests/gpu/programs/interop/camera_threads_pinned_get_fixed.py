# Source: plausible pattern (thread-per-camera video analytics in CuPy: every worker
# thread owns a cupy.cuda.Stream and a pinned host buffer for its per-frame result).
# ndarray.get(stream=s, out=pinned, blocking=False) only *enqueues* the device-to-host
# copy on s (cupy/_core/core.pyx ndarray.get calls stream.synchronize() only when
# blocking=True), but the worker reads the pinned buffer right away to build its report.
# Race (host-device): the D2H cudaMemcpyAsync on the camera stream writes
# self.row_energy while the host thread reads it (numpy .sum()), so the report can
# contain the previous frame's values (or zeros) instead of this frame's.
# Fix (_fixed.py): self.stream.synchronize() before the host reads the pinned buffer.
import threading

import numpy
import cupy
import cupyx

N_CAMERAS = 4
FRAMES = 8
H, W = 720, 1280
SPIN_CYCLES = 20_000_000  # ~10 ms per frame: detector/tracker kernels

_SPIN = cupy.RawKernel(r'''
extern "C" __global__ void spin_cycles(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
''', 'spin_cycles')


def gpu_spin(cycles):
    """Busy-wait on CuPy's current stream."""
    _SPIN((1,), (1,), (numpy.int64(cycles),))


def row_energy(d):
    """Per-row horizontal gradient energy of a float32 frame (works for numpy and cupy)."""
    xp = cupy.get_array_module(d)
    return xp.abs(xp.diff(d, axis=1)).sum(axis=1)


class CameraWorker(threading.Thread):
    def __init__(self, cam_id, frames):
        super().__init__(name=f'camera-{cam_id}')
        self.cam_id = cam_id
        self.frames = frames
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.row_energy = cupyx.zeros_pinned((H,), dtype=numpy.float32)
        self.report = []

    def run(self):
        cupy.cuda.Device(0).use()
        with self.stream:
            for f in self.frames:
                d = cupy.asarray(f).astype(cupy.float32)  # upload on this camera's stream
                gpu_spin(SPIN_CYCLES)
                e = row_energy(d)
                e.get(stream=self.stream, out=self.row_energy, blocking=False)
                # FIX: wait for the D2H copy before the host reads row_energy.
                self.stream.synchronize()
                self.report.append(float(self.row_energy.sum(dtype=numpy.float64)))


def main():
    rng = numpy.random.default_rng(17)
    frames = [[rng.integers(0, 256, size=(H, W), dtype=numpy.uint8) for _ in range(FRAMES)]
              for _ in range(N_CAMERAS)]

    # warm-up on the main thread: compile kernels once (host-synchronised)
    wd = cupy.asarray(frames[0][0]).astype(cupy.float32)
    row_energy(wd).get()
    gpu_spin(1)
    cupy.cuda.Device(0).synchronize()

    workers = [CameraWorker(c, frames[c]) for c in range(N_CAMERAS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    cupy.cuda.Device(0).synchronize()

    checksum = sum(sum(w.report) for w in workers)
    ref = sum(float(row_energy(f.astype(numpy.float32)).sum(dtype=numpy.float64))
              for cam in frames for f in cam)
    print(f'checksum={checksum:.1f} reference={ref:.1f} match={checksum == ref}')


if __name__ == '__main__':
    main()
