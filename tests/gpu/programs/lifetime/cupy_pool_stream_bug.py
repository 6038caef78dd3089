"""cupy_pool_stream (bug version).

Source: cupy/cupy#8068 "Better stream support in the CuPy's default memory pool":
  "if memory is allocated on stream A and then passed to a kernel to be executed on stream B,
   the memory chunk should not be reused until the kernel finishes in stream B. However, it is
   impossible for users to declare such dependencies; race conditions may happen if the user
   destructs the ndarray object."
cupy/cuda/memory.pyx: SingleDeviceMemoryPool.free() returns a chunk to the arena of the stream
it was allocated on (chunk.stream_ident); malloc() only searches the current stream's arena.

A spectrum pipeline: the compute stream produces a power array, an io stream post-processes it,
the Python reference is dropped, and the compute stream's next allocation of the same size
reuses the chunk.  The io stream's own allocations live in the io arena and are not a hazard.
"""
import cupy as cp

N, STEPS = 1 << 22, 6                 # 4 Mi float32 = 16 MiB per array


def main():
    cp.cuda.Device(0).use()
    compute = cp.cuda.Stream(non_blocking=True)
    io = cp.cuda.Stream(non_blocking=True)
    with compute:
        rng = cp.random.default_rng(0)
        frames = rng.standard_normal((STEPS, 2, N), dtype=cp.float32)   # re / im parts
        peaks = cp.zeros(STEPS, dtype=cp.float32)
    for i in range(STEPS):
        with compute:
            power = cp.hypot(frames[i, 0], frames[i, 1])    # allocated in compute's arena
            power *= 0.5
        io.wait_event(compute.record())
        with io:
            clipped = cp.minimum(power, 3.0)                # io stream reads power (io arena)
            peaks[i] = clipped.max()
        del power, clipped      # power's chunk goes back to compute's arena
    io.synchronize()
    compute.synchronize()
    print("peaks", [round(float(v), 3) for v in cp.asnumpy(peaks)])


if __name__ == "__main__":
    main()
