# Case cupy_pinned_ring (BUG version)
# Modeled on the race pointed out in cupy/cupy PR #5155 review (kmaehashi):
#   arr_cpu = cupyx.empty_pinned(...)
#   arr_gpu = cupy.array(arr_cpu)  # trigger HtoD async memcpy
#   arr_cpu[:] = 0  # this may run during HtoD
# in the shape of a RAPIDS-style chunked reader that streams a large pageable host
# array to the GPU through a small ring of pinned staging buffers on one CUDA stream.
# Bug: the host refills a pinned slot while the HtoD copy issued out of that slot
# N_SLOTS chunks earlier may still be reading it (no event/stream wait in between).
import numpy as np
import cupy
import cupyx

CHUNK = 1 << 20  # float32 elements per chunk (4 MiB)
N_CHUNKS = 16
N_SLOTS = 2


class PinnedChunkUploader:
    def __init__(self, chunk, n_slots):
        self.n_slots = n_slots
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.staging = [cupyx.empty_pinned((chunk,), dtype=np.float32)
                        for _ in range(n_slots)]
        with self.stream:
            self.device_bufs = [cupy.empty((chunk,), dtype=cupy.float32)
                                for _ in range(n_slots)]

    def upload(self, index, host_chunk):
        slot = index % self.n_slots
        staging = self.staging[slot]
        np.copyto(staging, host_chunk)  # host write into page-locked slot
        dst = self.device_bufs[slot]
        dst.set(staging, stream=self.stream)  # async HtoD out of the slot
        return dst


class ChunkStats:
    """Running sum / sum of squares / max, computed on the upload stream."""

    def __init__(self, stream):
        self.stream = stream
        with stream:
            self.acc = cupy.zeros(3, dtype=cupy.float64)
            self.acc[2] = -np.inf

    def update(self, x):
        with self.stream:
            self.acc[0] += x.sum(dtype=cupy.float64)
            self.acc[1] += cupy.square(x).sum(dtype=cupy.float64)
            self.acc[2] = cupy.maximum(self.acc[2], x.max())


def main():
    rng = np.random.default_rng(0)
    host = rng.standard_normal(CHUNK * N_CHUNKS, dtype=np.float32)  # pageable source
    uploader = PinnedChunkUploader(CHUNK, N_SLOTS)
    stats = ChunkStats(uploader.stream)
    for i in range(N_CHUNKS):
        chunk = uploader.upload(i, host[i * CHUNK:(i + 1) * CHUNK])
        stats.update(chunk)
    uploader.stream.synchronize()
    s, ss, mx = stats.acc.get()
    n = host.size
    print(f'gpu mean {s / n:.6f} var {ss / n - (s / n) ** 2:.6f} max {mx:.4f}')
    print(f'cpu mean {host.mean(dtype=np.float64):.6f} '
          f'var {host.var(dtype=np.float64):.6f} max {host.max():.4f}')


if __name__ == '__main__':
    main()
