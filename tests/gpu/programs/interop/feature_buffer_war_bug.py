# Source: RAPIDS-like plausible pattern (cuML/cuDF-style preprocessing written into a
# preallocated CuPy feature matrix, consumed by a torch scorer on its own torch stream
# through a zero-copy torch.from_dlpack view made once at start-up).  The producer ->
# consumer edge is present (cupy Event recorded on the featurizer stream, waited on by a
# cupy.cuda.ExternalStream wrapping the torch scorer stream), but the consumer ->
# producer edge is missing: the next batch's feature kernels on GpuFeaturizer.stream
# overwrite the shared `features` buffer while the torch MLP on TorchScorer.stream may
# still be reading the previous batch (device-device write-after-read race).
# Fix (_fixed.py): after launching the scorer, record a cupy Event on
# cupy.cuda.ExternalStream(scorer.stream.cuda_stream) and make the featurizer stream wait on it.
import numpy
import torch
import cupy

ROWS = 1 << 15
COLS = 128
ITERS = 10
SPIN_CYCLES = 30_000_000  # ~15 ms: stands in for a bigger model on the torch stream


class GpuFeaturizer:
    def __init__(self, rows, cols):
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.features = cupy.empty((rows, cols), dtype=cupy.float32)
            self.features_t = torch.from_dlpack(self.features)  # zero-copy view for torch
        self.stream.synchronize()

    def transform(self, raw):
        with self.stream:
            cupy.log1p(cupy.abs(raw), out=self.features)
            self.features -= self.features.mean(axis=0, keepdims=True)
            return self.stream.record()


class TorchScorer:
    def __init__(self, cols):
        self.stream = torch.cuda.Stream()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(cols, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda().eval()

    @torch.no_grad()
    def score(self, feats_t, ready, busy=True):
        cupy.cuda.ExternalStream(self.stream.cuda_stream).wait_event(ready)
        with torch.cuda.stream(self.stream):
            if busy:
                torch.cuda._sleep(SPIN_CYCLES)
            return self.model(feats_t)


def main():
    torch.manual_seed(0)
    rng = numpy.random.default_rng(9)
    raws = [cupy.asarray(rng.standard_normal((ROWS, COLS), dtype=numpy.float32))
            for _ in range(ITERS)]
    cupy.cuda.Device(0).synchronize()

    feat = GpuFeaturizer(ROWS, COLS)
    scorer = TorchScorer(COLS)
    torch.cuda.synchronize()

    # warm-up (kernel compilation, cuBLAS), host-synchronised
    scorer.score(feat.features_t, feat.transform(raws[0]), busy=False)
    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()

    outs = []
    for i in range(ITERS):
        ready = feat.transform(raws[i])
        outs.append(scorer.score(feat.features_t, ready))
        # BUG: the featurizer never waits for the scorer, so the next transform() may
        # overwrite feat.features while the model is still reading it.

    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()

    checksum = sum(o.sum(dtype=torch.float64).item() for o in outs)
    ref = 0.0
    err = 0.0
    with torch.no_grad():
        for o, r in zip(outs, raws):
            f = cupy.log1p(cupy.abs(r))
            f -= f.mean(axis=0, keepdims=True)
            cupy.cuda.Device(0).synchronize()
            expected = scorer.model(torch.from_dlpack(f))
            ref += expected.sum(dtype=torch.float64).item()
            err = max(err, (o - expected).abs().max().item())
    ok = err <= 1e-3
    print(f'checksum={checksum:.6f} reference={ref:.6f} max_abs_err={err:.2e} match={ok}')


if __name__ == '__main__':
    main()
