"""Frame-ingest pipeline (CuPy): a decoder thread writes frames into a ring of
pinned host slots and hands slot indices to a GPU thread through queue.Queue;
the GPU thread uploads each slot with an async H2D copy on its own stream,
filters it, and hands the slot back (with an event) through a free queue.

Modeled on: cupy/cupy PR #5155 review thread (kmaehashi: writing `arr_cpu[:]`
of a pinned numpy array "may run during HtoD" once the upload is asynchronous)
and cupy/cupy issue #6785 (`ndarray.set()` uploads straight from the caller's
buffer, no staging copy).  Self-contained re-creation.

FIXED: the slot's "upload done" event is recorded AFTER the upload that reads
the slot, so the decoder's event.synchronize() orders its overwrite after the
copy out of the slot.
"""
import queue
import threading

import cupy as cp
import cupyx
import numpy as np

N_FRAMES = 12
N_SLOTS = 3
H, W = 256, 256


def decode_frame(i, out):
    """Stand-in for a video decoder writing straight into a pinned slot."""
    rng = np.random.default_rng(i)
    frame = rng.random((H, W), dtype=np.float32)
    np.copyto(out, frame)


class Decoder(threading.Thread):
    def __init__(self, ring, free_q, ready_q):
        super().__init__(name="decoder", daemon=True)
        self.ring, self.free_q, self.ready_q = ring, free_q, ready_q

    def run(self):
        for i in range(N_FRAMES):
            slot, upload_done = self.free_q.get(timeout=60)
            if upload_done is not None:
                upload_done.synchronize()  # slot no longer read by the GPU?
            decode_frame(i, self.ring[slot])
            self.ready_q.put((i, slot))
        self.ready_q.put(None)


class GpuStage(threading.Thread):
    def __init__(self, ring, free_q, ready_q):
        super().__init__(name="gpu-stage", daemon=True)
        self.ring, self.free_q, self.ready_q = ring, free_q, ready_q
        self.result = None

    def run(self):
        cp.cuda.Device(0).use()
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            dev = cp.empty((H, W), dtype=cp.float32)
            acc = cp.zeros((H, W), dtype=cp.float32)
            while (item := self.ready_q.get(timeout=60)) is not None:
                i, slot = item
                dev.set(self.ring[slot], stream=stream)  # async H2D from pinned slot
                upload_done = cp.cuda.Event()
                upload_done.record(stream)
                self.free_q.put((slot, upload_done))
                blurred = (dev + cp.roll(dev, 1, axis=0) + cp.roll(dev, 1, axis=1)) / 3
                acc += cp.tanh(blurred) * (i + 1)
            self.result = float(acc.sum().get(stream=stream))
        stream.synchronize()


def main():
    ring = [cupyx.empty_pinned((H, W), dtype=np.float32) for _ in range(N_SLOTS)]
    free_q, ready_q = queue.Queue(), queue.Queue()
    for s in range(N_SLOTS):
        free_q.put((s, None))
    dec = Decoder(ring, free_q, ready_q)
    gpu = GpuStage(ring, free_q, ready_q)
    gpu.start()
    dec.start()
    dec.join()
    gpu.join()
    print(f"processed {N_FRAMES} frames, checksum {gpu.result:.3f}")


if __name__ == "__main__":
    main()
