# Case: ema_side_stream (BUG version)
# Source: the EMA update is timm's ModelEmaV3.apply_update_
# (huggingface/pytorch-image-models, timm/utils/model_ema.py: torch._foreach_lerp_ over
# state_dict values). Moving it to a CUDA stream to overlap with training was proposed in
# pytorch/pytorch PR #94820 ("Optimized EMA implementation": "_foreach APIs and
# asynchronous work (CUDA stream or CPU thread)"). The stream usage here is a plausible
# pattern, not a copy of a specific buggy file.
# Bug: the EMA stream correctly waits for the optimizer step before reading the model
# weights, but the *next* optimizer.step() (default stream, in-place _foreach_add_ on the
# params) is never ordered after the EMA lerp that reads those same params (WAR race).
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class Block(nn.Module):
    def __init__(self, d=768):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class StreamModelEma:
    """ModelEmaV3-style EMA whose update runs on a private stream."""

    def __init__(self, model, decay=0.999, warmup=True):
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay
        self.warmup = warmup
        self.stream = torch.cuda.Stream(device=DEV)

    def get_decay(self, step):
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, model, step):
        decay = self.get_decay(step)
        # wait for the optimizer step that produced the new weights
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            ema_vals, model_vals = [], []
            for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
                if ema_v.is_floating_point():
                    ema_vals.append(ema_v)
                    model_vals.append(model_v)
                else:
                    ema_v.copy_(model_v)
            torch._foreach_lerp_(ema_vals, model_vals, weight=1.0 - decay)


def main():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).to(DEV)
    ema = StreamModelEma(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(64, 128, 768, generator=g).to(DEV),
             torch.randn(64, 128, 768, generator=g).to(DEV)) for _ in range(6)]
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        # (missing: torch.cuda.current_stream().wait_stream(ema.stream))
        opt.step()  # in-place write of params the EMA stream may still be reading
        ema.update(model, step)
    # evaluate the EMA weights on the default stream
    torch.cuda.current_stream().wait_stream(ema.stream)
    with torch.no_grad():
        err = F.mse_loss(ema.module(data[0][0]), data[0][1])
    print("ema eval loss %.4f" % err.item())


if __name__ == "__main__":
    main()
