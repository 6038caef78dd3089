# Case: scaler_skip_check_stream (BUG version)
# Source: the overflow check of huggingface/accelerate src/accelerate/optimizer.py
# (AcceleratedOptimizer.step: scale_before = scaler.get_scale(); scaler.step(); scaler.update();
# scale_after = scaler.get_scale(); self._is_overflow = scale_after < scale_before) and of
# older transformers Trainer loops ("optimizer_was_run = scale_before <= scale_after").
# Here the scaler step + update were moved to an optimizer stream (plausible pattern).
# GradScaler.get_scale() is `self._scale.item()`: a D2H copy on the *current* stream
# followed by a sync of that stream only.
# Bug: scale_after = get_scale() runs on the default stream right after the optimizer-stream
# block; its D2H read of _scale is not ordered after the _amp_update_scale_ kernel that
# writes _scale on opt_stream. The .item() looks like a sync but syncs the wrong stream.
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class StreamedAmpOptimizer:
    """accelerate-style optimizer wrapper that reports skipped (overflow) steps."""

    def __init__(self, optimizer, scaler):
        self.optimizer = optimizer
        self.scaler = scaler
        self.stream = torch.cuda.Stream(device=DEV)
        self.is_overflow = False

    def zero_grad(self):
        torch.cuda.current_stream().wait_stream(self.stream)  # previous step complete
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        scale_before = self.scaler.get_scale()
        self.stream.wait_stream(torch.cuda.current_stream())  # grads are ready
        with torch.cuda.stream(self.stream):
            self.scaler.step(self.optimizer)
            self.scaler.update()
        # (missing: torch.cuda.current_stream().wait_stream(self.stream))
        scale_after = self.scaler.get_scale()  # .item() on the default stream
        self.is_overflow = scale_after < scale_before


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # a huge initial scale makes the first steps overflow, as in real fp16 warm-up
    wrapped = StreamedAmpOptimizer(opt, torch.amp.GradScaler("cuda", init_scale=2.0**24))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(14)
    data = [(torch.randn(512, 512, generator=g).to(DEV), torch.randn(512, 512, generator=g).to(DEV))
            for _ in range(8)]
    skipped = 0
    for x, y in data:
        wrapped.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        wrapped.scaler.scale(loss).backward()
        wrapped.step()
        if wrapped.is_overflow:
            skipped += 1
        else:
            sched.step()
    torch.cuda.synchronize()
    print("skipped %d of %d steps, final scale %.0f" % (skipped, len(data), wrapped.scaler.get_scale()))


if __name__ == "__main__":
    main()
