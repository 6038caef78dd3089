# Case overflow_check (FIXED version)
# Modeled on deepspeedai/DeepSpeed PR #501 (ZeRO stage2 `_async_has_inf_or_nan`).
# Fix keeps the D2H copies asynchronous and batched: an event is recorded on the
# current stream after the last copy and the host polls event.query() until it
# reports completion before reading the pinned slots.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class DynamicLossScaler:
    def __init__(self, init_scale=2.0 ** 12, scale_factor=2.0, scale_window=4):
        self.cur_scale = init_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.last_overflow_iter = -1
        self.cur_iter = 0

    def update_scale(self, overflow):
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1.0)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class AsyncOverflowChecker:
    """One pinned float slot per parameter, so all D2H copies can be queued at once."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.flags = torch.zeros(len(self.params), dtype=torch.float32, pin_memory=True)
        self.copied = torch.cuda.Event()

    def has_overflow(self):
        for i, p in enumerate(self.params):
            partial = p.grad.float().sum()
            self.flags[i].copy_(partial, non_blocking=True)
        self.copied.record()  # FIX: wait for the queued D2H copies before reading
        while not self.copied.query():
            pass
        sums = self.flags.tolist()
        return not all(math.isfinite(s) for s in sums)


class MLP(nn.Module):
    def __init__(self, d=512, h=1024):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, h)
        self.fc3 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def make_batches(n, bs, d, device):
    g = torch.Generator(device=device).manual_seed(0)
    batches = []
    for i in range(n):
        x = torch.randn(bs, d, device=device, generator=g)
        y = torch.randn(bs, d, device=device, generator=g)
        if i == 6:
            x[0, 0] = float('inf')  # poisoned sample: this step must be skipped
        batches.append((x, y))
    return batches


def train(model, batches, optimizer, scaler, checker):
    skipped = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        (loss * scaler.cur_scale).backward()
        overflow = checker.has_overflow()
        if overflow:
            skipped.append(step)
        else:
            for p in checker.params:
                p.grad.div_(scaler.cur_scale)
            optimizer.step()
        scaler.update_scale(overflow)
    return skipped


def main():
    torch.manual_seed(0)
    device = torch.device('cuda', 0)
    model = MLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = DynamicLossScaler()
    checker = AsyncOverflowChecker(model.parameters())
    batches = make_batches(16, 256, 512, device)
    skipped = train(model, batches, optimizer, scaler, checker)
    w = model.fc1.weight.norm().item()
    print(f'skipped steps {skipped}, final scale {scaler.cur_scale}, |fc1.w| {w:.4f}')


if __name__ == '__main__':
    main()
