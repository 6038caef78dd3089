# Case cupy_pool_reuse (BUG version)
# Modeled on cupy/cupy#8068 "Better stream support in the CuPy's default memory pool":
# "if memory is allocated on stream A and then passed to a kernel to be executed on
# stream B, the memory chunk should not be reused until the kernel finishes in stream B
# ... race conditions may happen if the user destructs the ndarray object". CuPy has no
# record_stream(); the maintainers' answer (leofang) is that users declare the order
# themselves with Stream.wait_event. RAPIDS-style two-stage pipeline: a decoder stream
# turns quantized int16 columns into float32 columns, a reducer stream computes
# per-column statistics. Bug: each decoded column is freed back to the decoder stream's
# arena while the reducer stream may still be reading it; the next column is carved
# out of the same chunk and overwritten by the decoder stream.
import numpy as np
import cupy

N = 1 << 22  # elements per column (16 MiB as float32)
N_COLUMNS = 8

decode_q16 = cupy.ElementwiseKernel(
    'int16 q, float32 scale, float32 offset', 'float32 y',
    'y = q * scale + offset', 'decode_q16')


class ColumnDecoder:
    def __init__(self):
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def decode(self, raw, scale, offset):
        with self.stream:
            col = cupy.empty(raw.shape, dtype=cupy.float32)  # from this stream's arena
            decode_q16(raw, np.float32(scale), np.float32(offset), col)
            ready = self.stream.record()
        return col, ready


class ColumnReducer:
    def __init__(self, n_columns):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.stats = cupy.zeros((n_columns, 2), dtype=cupy.float32)

    def reduce(self, i, col, ready):
        self.stream.wait_event(ready)  # read the column only after it is decoded
        with self.stream:
            self.stats[i, 0] = col.mean()
            self.stats[i, 1] = col.std()
        return self.stream.record()


def load_raw_columns(rng):
    raws = []
    for _ in range(N_COLUMNS):
        q = rng.integers(-20000, 20000, size=N, dtype=np.int16)
        raw = cupy.empty(N, dtype=cupy.int16)
        raw.set(q)
        raws.append(raw)
    cupy.cuda.runtime.deviceSynchronize()
    return raws


def main():
    rng = np.random.default_rng(0)
    raws = load_raw_columns(rng)
    decoder = ColumnDecoder()
    reducer = ColumnReducer(N_COLUMNS)
    for i, raw in enumerate(raws):
        col, ready = decoder.decode(raw, 0.001 * (i + 1), float(i))
        done = reducer.reduce(i, col, ready)
        del col  # chunk returns to the decoder stream's free list
    reducer.stream.synchronize()
    stats = reducer.stats.get()
    for i in range(N_COLUMNS):
        print(f'column {i}: mean {stats[i, 0]:.4f} std {stats[i, 1]:.4f}')


if __name__ == '__main__':
    main()
