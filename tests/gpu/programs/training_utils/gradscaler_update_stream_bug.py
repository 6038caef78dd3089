# Case: gradscaler_update_stream (BUG version)
# Source: plausible pattern, built on the real torch.amp.GradScaler code path for
# optimizers with _step_supports_amp_scaling (fused AdamW): torch/amp/grad_scaler.py
# GradScaler.step() calls _check_inf_per_device() (allocates found_inf and runs
# _amp_foreach_non_finite_check_and_unscale_ on the *current* stream) and reads
# self._scale via `scaler * getattr(optimizer, "grad_scale", 1)`; GradScaler.update()
# then reads found_inf and rewrites self._scale in place with _amp_update_scale_.
# Neither method synchronizes, so both must run on the same stream.
# Bug: scaler.step() runs under the optimizer stream, but scaler.update() is called
# after leaving the `with torch.cuda.stream(...)` block, i.e. on the default stream,
# with no wait on opt_stream: update reads found_inf written on opt_stream (RAW) and
# overwrites _scale that opt_stream is still reading (WAR).
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class Net(nn.Module):
    def __init__(self, d=512, h=2048, n_cls=100):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU())
        self.head = nn.Linear(h, n_cls)

    def forward(self, x):
        return self.head(self.body(x))


class AmpTrainer:
    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14)
        self.opt_stream = torch.cuda.Stream(device=DEV)

    def train_step(self, x, y):
        # params / grads from the previous step must be complete before we touch them
        torch.cuda.current_stream().wait_stream(self.opt_stream)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = self.model(x)
            loss = F.cross_entropy(logits, y)
        self.scaler.scale(loss).backward()
        self.opt_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.opt_stream):
            self.scaler.step(self.opt)  # found_inf / grad_scale computed on opt_stream
        self.scaler.update()  # runs on the default stream, unordered with opt_stream
        return loss.detach()


def main():
    torch.manual_seed(0)
    model = Net().to(DEV)
    trainer = AmpTrainer(model)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(256, 512, generator=g).to(DEV),
             torch.randint(0, 100, (256,), generator=g).to(DEV)) for _ in range(6)]
    losses = [trainer.train_step(x, y) for x, y in data]
    torch.cuda.synchronize()
    print("loss %.4f scale %.1f" % (torch.stack(losses)[-1].item(), trainer.scaler.get_scale()))


if __name__ == "__main__":
    main()
