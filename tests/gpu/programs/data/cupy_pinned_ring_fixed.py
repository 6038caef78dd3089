# Case cupy_pinned_ring (FIXED version)
# Modeled on the race pointed out in cupy/cupy PR #5155 review (host writes a pinned
# buffer while an async HtoD copy out of it may be running). Fix: an event is recorded
# on the upload stream right after each slot's HtoD copy, and before the host refills
# that slot it blocks on that slot's event only (Event.synchronize), so the other
# slot's copy and all compute keep overlapping with the host work.
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
        self.copy_done = [None] * n_slots

    def upload(self, index, host_chunk):
        slot = index % self.n_slots
        staging = self.staging[slot]
        if self.copy_done[slot] is not None:
            self.copy_done[slot].synchronize()  # FIX: previous HtoD out of this slot done
        np.copyto(staging, host_chunk)  # host write into page-locked slot
        dst = self.device_bufs[slot]
        dst.set(staging, stream=self.stream)  # async HtoD out of the slot
        self.copy_done[slot] = self.stream.record()
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
