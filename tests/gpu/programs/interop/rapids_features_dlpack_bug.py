# Source: RAPIDS-style tabular pipeline (cuDF/cuML-like feature engineering in CuPy on a
# dedicated stream, then a torch model), plausible pattern following the DLPack hand-off
# that RAPIDS/CuPy interoperability docs recommend (torch.from_dlpack(cupy_array)).
# cupy/_core/core.pyx ndarray.__dlpack__(stream) treats CuPy's *current* stream as the
# producer stream.  The features are computed inside `with self.stream:` but
# torch.from_dlpack() is called after the block, when CuPy's current stream is the null
# (legacy default) stream.  torch passes its current stream (legacy default -> stream=1),
# which CuPy considers identical to its own current stream, so no event/wait is
# inserted at all: the torch MLP on the default stream reads `feats` while the feature
# kernels on FeatureBuilder.stream may still be writing them (device-device race).
# Fix (_fixed.py): call torch.from_dlpack(feats) inside `with builder.stream:`.
import numpy
import torch
import cupy

ROWS = 1 << 15
F = 64
ITERS = 12
SPIN_CYCLES = 30_000_000  # ~15 ms: stands in for groupby/join/encoding work

_SPIN = cupy.RawKernel(r'''
extern "C" __global__ void spin_cycles(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
''', 'spin_cycles')


def gpu_spin(cycles):
    """Busy-wait on CuPy's current stream."""
    _SPIN((1,), (1,), (numpy.int64(cycles),))


class FeatureBuilder:
    """cuDF/cuML-style feature computation on its own CuPy stream."""

    def __init__(self):
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def build(self, raw_host, heavy=True):
        with self.stream:
            raw = cupy.asarray(raw_host)
            if heavy:
                gpu_spin(SPIN_CYCLES)
            mu = raw.mean(axis=0)
            sd = raw.std(axis=0)
            feats = (raw - mu) / (sd + numpy.float32(1e-6))
        return feats


def reference(model, raw_host):
    f = torch.from_numpy(raw_host).cuda()
    f = (f - f.mean(0)) / (f.std(0, correction=0) + 1e-6)
    return model(f)


def main():
    torch.manual_seed(0)
    rng = numpy.random.default_rng(7)
    batches = [(rng.standard_normal((ROWS, F), dtype=numpy.float32) * 3.0 + 1.0)
               .astype(numpy.float32) for _ in range(ITERS)]

    builder = FeatureBuilder()
    model = torch.nn.Sequential(
        torch.nn.Linear(F, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda().eval()

    with torch.no_grad():
        # warm-up: compile CuPy kernels, initialise cuBLAS (host-synchronised)
        wf = builder.build(batches[0], heavy=False)
        builder.stream.synchronize()
        model(torch.from_dlpack(wf)).sum().item()
        gpu_spin(1)
        del wf
        cupy.cuda.Device(0).synchronize()

        total = 0.0
        outs = []
        for i in range(ITERS):
            feats = builder.build(batches[i])
            # BUG: CuPy's current stream here is the null stream, not builder.stream, so
            # __dlpack__ does not order torch's stream after the feature kernels.
            x = torch.from_dlpack(feats)
            y = model(x)
            outs.append(y)
            total += y.sum(dtype=torch.float64).item()  # loss/metric logging

        torch.cuda.synchronize()
        cupy.cuda.Device(0).synchronize()

        refs = [reference(model, b) for b in batches]
        ref = sum(r.sum(dtype=torch.float64).item() for r in refs)
        err = max((o - r).abs().max().item() for o, r in zip(outs, refs))
    ok = err <= 1e-3
    print(f'checksum={total:.6f} reference={ref:.6f} max_abs_err={err:.2e} match={ok}')


if __name__ == '__main__':
    main()
