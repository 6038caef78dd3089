# Source: cupy/cupy issue #8068 "Better stream support in the CuPy's default
#   memory pool": CuPy's pool arena is per stream, so memory allocated on
#   stream A and used by a kernel on stream B can be reused by A as soon as
#   the ndarray is destructed; there is no record_stream equivalent and users
#   must order the streams themselves (Stream.wait_event).  PyTorch's
#   Tensor.record_stream() cannot help either: CUDACachingAllocator::
#   recordStream() skips pointers it did not allocate (DLPack imports).
# Pattern: features are produced by CuPy on its own non-blocking stream,
# handed to PyTorch through DLPack (torch.from_dlpack makes the torch stream
# wait for CuPy's current stream), reduced on a torch side stream, and then
# both handles are dropped; CuPy's pool gives the chunk to the next step's
# CuPy kernels while the torch stream may still be reading it.
import os

os.environ.setdefault("CUPY_CACHE_IN_MEMORY", "1")  # keep CuPy's kernel cache off disk

import cupy as cp  # noqa: E402
import torch  # noqa: E402

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
N = 1 << 22
STEPS = 6


def produce(base, step):
    # allocated from CuPy's default memory pool on the current CuPy stream
    return cp.sin(base * (step + 1))


def main():
    torch.manual_seed(0)
    cp_stream = cp.cuda.Stream(non_blocking=True)
    reader = torch.cuda.Stream()

    with cp_stream:
        base = cp.arange(N, dtype=cp.float32) * (1.0 / N)
    cp_stream.synchronize()
    # reference on a separate CuPy stream, so cp_stream's pool arena stays small
    ref_stream = cp.cuda.Stream(non_blocking=True)
    with ref_stream:
        ref = [float(cp.square(produce(base, s).astype(cp.float64)).sum()) for s in range(STEPS)]
    ref_stream.synchronize()
    reference = sum(ref)
    torch.cuda.synchronize()

    results = []
    for step in range(STEPS):
        with cp_stream:
            feat = produce(base, step)
            with torch.cuda.stream(reader):
                t = torch.from_dlpack(feat)          # reader waits for cp_stream (DLPack stream arg)
                torch.cuda._sleep(SLEEP_CYCLES)      # reader stream busy with earlier work
                results.append(t.double().square().sum())
                t.record_stream(reader)              # no effect: memory belongs to CuPy's pool
        del t, feat                                  # CuPy chunk returns to cp_stream's arena
    torch.cuda.current_stream().wait_stream(reader)
    checksum = torch.stack(results).sum().item()
    torch.cuda.synchronize()
    match = abs(checksum - reference) <= 1e-6 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
