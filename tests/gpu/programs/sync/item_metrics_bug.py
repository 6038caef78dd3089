# item_metrics (BUG version)
# Source: async metric logging through pinned memory on a side stream, the
# pattern discussed in pytorch/tutorials PR #3261 (GPU->CPU non_blocking copies
# need an explicit sync before the host reads) and sgl-project/sglang PR #16493
# (non_blocking D2H not followed by a synchronization). The belief that
# `loss.item()` "synchronizes the GPU" is the plausible bug here.
# Semantics: Tensor.item() runs memcpy_and_sync() on the CURRENT stream only
# (aten/src/ATen/native/cuda/CUDAScalar.cu): the host is ordered after the main
# stream, not after other streams.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
DEV = torch.device("cuda:0")
BATCH, FEAT, STEPS = 128, 1024, 6


class AsyncMetrics:
    """Copies step metrics to pinned host memory on a side stream."""

    def __init__(self, n):
        self.stream = torch.cuda.Stream()
        self.dev = torch.zeros(n, device=DEV)                 # staging slot (main)
        self.host = torch.zeros(n, pin_memory=True)           # pinned mirror

    def stage(self, *vals):
        main = torch.cuda.current_stream()
        main.wait_stream(self.stream)            # previous D2H finished reading dev
        for i, v in enumerate(vals):
            self.dev[i].copy_(v.detach())
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            self.host.copy_(self.dev, non_blocking=True)      # D2H on side stream

    def read(self):
        return self.host.tolist()                             # host reads pinned


def main():
    model = torch.nn.Sequential(
        torch.nn.Linear(FEAT, FEAT), torch.nn.ReLU(), torch.nn.Linear(FEAT, FEAT)
    ).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    metrics = AsyncMetrics(3)
    log = []
    for step in range(STEPS):
        x = torch.randn(BATCH, FEAT, device=DEV)
        y = torch.randn(BATCH, FEAT, device=DEV)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        metrics.stage(loss, gnorm, x.abs().mean())
        loss_val = loss.item()           # BUG: only the main stream is synchronized
        m = metrics.read()               # ...but the D2H runs on metrics.stream
        log.append((step, loss_val, m))
    torch.cuda.synchronize()
    print(log[-1])


if __name__ == "__main__":
    main()
