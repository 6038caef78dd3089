# Case: metrics_d2h_stream (BUG version)
# Source: modeled on meta-pytorch/torchrec PR #4386 ("Isolate ZORM DtoH on dedicated CUDA
# stream": metric device-to-host copies issued on a dedicated per-device stream into
# pinned CPU buffers). The synchronization mistake is a plausible pattern.
# Metrics (loss sum, correct count, sample count) are accumulated on the GPU every step
# and fetched for logging every few steps through a dedicated D2H stream.
# Bug: the logger synchronizes the *compute* stream (torch.cuda.current_stream()) instead
# of the D2H stream before reading the pinned buffer with .tolist(), so the host read is
# not ordered after the non_blocking copy issued on d2h_stream.
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class GpuMetricTracker:
    def __init__(self):
        self.acc = torch.zeros(3, dtype=torch.float64, device=DEV)  # loss_sum, correct, count
        self.host = torch.empty(3, dtype=torch.float64, pin_memory=True)
        self.d2h_stream = torch.cuda.Stream(device=DEV)

    @torch.no_grad()
    def update(self, loss, logits, target):
        n = target.numel()
        correct = (logits.argmax(dim=-1) == target).sum()
        upd = torch.stack([loss.detach().double() * n, correct.double(),
                           torch.full((), float(n), dtype=torch.float64, device=DEV)])
        self.acc.add_(upd)

    def compute_and_reset(self):
        cur = torch.cuda.current_stream()
        self.d2h_stream.wait_stream(cur)  # accumulators are complete
        with torch.cuda.stream(self.d2h_stream):
            self.host.copy_(self.acc, non_blocking=True)
        cur.synchronize()  # waits for the compute stream only
        loss_sum, correct, count = self.host.tolist()  # host reads pinned memory
        # the accumulators may be reset only after the D2H copy has read them
        cur.wait_stream(self.d2h_stream)
        self.acc.zero_()
        return {"loss": loss_sum / max(count, 1.0), "acc": correct / max(count, 1.0)}


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 20)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    tracker = GpuMetricTracker()
    g = torch.Generator().manual_seed(9)
    data = [(torch.randn(1024, 256, generator=g).to(DEV),
             torch.randint(0, 20, (1024,), generator=g).to(DEV)) for _ in range(8)]
    logs = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        tracker.update(loss, logits, y)
        if step % 4 == 3:
            logs.append(tracker.compute_and_reset())
    torch.cuda.synchronize()
    for rec in logs:
        print("loss %.4f acc %.4f" % (rec["loss"], rec["acc"]))


if __name__ == "__main__":
    main()
