# Source: plausible pattern built on Lightning's EarlyStopping callback
#   (src/lightning/pytorch/callbacks/early_stopping.py: on_validation_end -> _run_early_stopping_check reads
#   the monitored metric on the host) made non-blocking: the metric is copied to pinned memory on a transfer
#   stream owned by an offload extension (handed over as a raw cudaStream_t and wrapped in
#   torch.cuda.ExternalStream), and the trainer polls Event.query() instead of blocking.
#   torch.cuda.Event.record() without an argument records on torch.cuda.current_stream(); called after the
#   `with torch.cuda.stream(...)` block it marks the compute stream, not the copy, so query() turns True
#   before the D2H copy has run.
import math
import time

import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms: the transfer stream is still moving an offloaded checkpoint shard
DEVICE = torch.device("cuda", 0)
MAX_EPOCHS = 12
PATIENCE = 2


class AsyncEarlyStopping:
    def __init__(self, transfer_stream, patience):
        self.transfer_stream = transfer_stream
        self.patience = patience
        self.monitored = torch.zeros((), dtype=torch.float32, pin_memory=True)
        self.ready = torch.cuda.Event()
        self.best = math.inf
        self.wait_count = 0
        self.seen = []
        self.should_stop = False

    def on_validation_end(self, val_loss):
        self.transfer_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.transfer_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            self.monitored.copy_(val_loss, non_blocking=True)
        self.ready.record()

    def poll(self):
        """Non-blocking check; returns True once the decision for this epoch has been made."""
        if not self.ready.query():
            return False
        current = float(self.monitored)
        self.seen.append(current)
        if current < self.best - 1e-4:
            self.best = current
            self.wait_count = 0
        else:
            self.wait_count += 1
            self.should_stop = self.wait_count >= self.patience
        return True


def reference_stop(values, patience):
    best, wait, seen = math.inf, 0, []
    for v in values:
        seen.append(v)
        if v < best - 1e-4:
            best, wait = v, 0
        else:
            wait += 1
            if wait >= patience:
                break
    return seen


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(2048, 256, device=DEVICE), torch.randn(2048, 1, device=DEVICE)
    xv, yv = torch.randn(1024, 256, device=DEVICE), torch.randn(1024, 1, device=DEVICE)
    # The offload extension owns the transfer stream and only exposes its handle.
    owner_stream = torch.cuda.Stream()
    transfer_stream = torch.cuda.ExternalStream(owner_stream.cuda_stream)
    torch.cuda.synchronize()

    early_stopping = AsyncEarlyStopping(transfer_stream, PATIENCE)
    logged_metrics = []  # like trainer.callback_metrics history: keeps every val_loss tensor alive
    for _ in range(MAX_EPOCHS):
        for _ in range(4):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            val_loss = nn.functional.mse_loss(model(xv), yv)
        logged_metrics.append(val_loss)
        early_stopping.on_validation_end(val_loss)
        while not early_stopping.poll():
            time.sleep(0.0005)  # the host does other work (data prep, logging) meanwhile
        if early_stopping.should_stop:
            break

    torch.cuda.synchronize()
    true_values = [v.item() for v in logged_metrics]
    reference = reference_stop(true_values, PATIENCE)
    checksum = sum(early_stopping.seen)
    match = early_stopping.seen == reference
    print(f"checksum={checksum:.6f} reference={sum(reference):.6f} match={match}")


if __name__ == "__main__":
    main()
