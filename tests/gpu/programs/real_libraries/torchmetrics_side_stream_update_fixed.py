# Source: torchmetrics src/torchmetrics/regression/mse.py (MeanSquaredError.update: _mean_squared_error_update
#   reads preds/target and accumulates sum_squared_error/total in place) and metric.py (Metric._wrap_update);
#   user code moves metric bookkeeping to a side stream so it overlaps the next validation forward pass.
# Bug: preds are produced (and allocated) on the default stream and read by metric.update() on the metric
#   stream, but never record_stream()'d there. When the loop rebinds `preds`, the block goes back to the
#   default stream's pool immediately, and the output of a later forward pass is allocated in it and written
#   by the default stream before the (lagging) metric stream has read the old predictions: missing
#   record_stream for a tensor allocated on the default stream and used on the metric stream.
# Fix: preds.record_stream(self.stream) after enqueuing the update, so the allocator keeps the block until
#   the metric stream is done with it. (The compute() side is already right: it waits for the metric stream.)
# This file: FIXED version.
import torch
import torch.nn as nn
from torchmetrics.regression import MeanSquaredError

DEVICE = torch.device("cuda", 0)
D_IN, D_HID, D_OUT, BATCH, N_BATCHES = 256, 1024, 8, 512, 12  # hidden activations: 2 MiB (large pool)
SLEEP_CYCLES = 30_000_000  # ~15 ms: heavier metrics (a whole collection) on the side stream


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D_IN, D_HID), nn.GELU(), nn.Linear(D_HID, D_HID), nn.GELU(),
                                 nn.Linear(D_HID, D_OUT))

    def forward(self, x):
        return self.net(x)


class AsyncMetricUpdater:
    """metric.update() on a side stream, metric.compute() back on the caller's stream."""

    def __init__(self, metric, device):
        self.metric = metric
        self.stream = torch.cuda.Stream(device)

    def update(self, preds, target):
        self.stream.wait_stream(torch.cuda.current_stream())  # preds must be written before we read them
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            self.metric.update(preds, target)
        preds.record_stream(self.stream)  # FIX: allocated on the caller's stream, read on the metric stream

    def compute(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        return self.metric.compute()


def main():
    torch.manual_seed(0)
    model = Regressor().to(DEVICE).eval()
    xs = [torch.randn(BATCH, D_IN).to(DEVICE) for _ in range(N_BATCHES)]
    ys = [torch.randn(BATCH, D_OUT).to(DEVICE) for _ in range(N_BATCHES)]
    updater = AsyncMetricUpdater(MeanSquaredError().to(DEVICE), DEVICE)
    torch.cuda.synchronize()

    with torch.no_grad():
        for x, y in zip(xs, ys):
            preds = model(x)
            updater.update(preds, y)
    mse = updater.compute().item()

    # Reference: a second metric updated synchronously on the default stream.
    torch.cuda.synchronize()
    ref_metric = MeanSquaredError().to(DEVICE)
    with torch.no_grad():
        for x, y in zip(xs, ys):
            ref_metric.update(model(x), y)
    ref = ref_metric.compute().item()
    ok = abs(mse - ref) <= 1e-5 * max(1.0, abs(ref))
    print(f"val_mse={mse:.6f} reference={ref:.6f}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
