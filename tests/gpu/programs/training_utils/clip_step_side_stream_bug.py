# Case: clip_step_side_stream (BUG version)
# Source: plausible pattern. Same shape as the "optimizer on its own stream" overlap
# (pytorch/pytorch PR #89963, optimizer_overlap_hooks.py) and the stream-overlapped
# optimizer step in PrimeIntellect-ai/prime-rl PR #3109 (src/prime_rl/trainer/optim.py),
# where review found "the first H2D also never waits on the compute stream".
# Here gradient clipping (clip_grad_norm_, foreach) plus a foreach SGD step are moved
# to a side stream; the author joins the side stream back before the next forward but
# forgets the fork edge after backward.
# Bug: _foreach_norm / _foreach_mul_ / SGD _foreach_add_ on opt_stream read the .grad
# tensors that loss.backward() writes on the default stream, with no
# opt_stream.wait_stream(default) in between.
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class ConvNet(nn.Module):
    def __init__(self, n_cls=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 8 * 8, n_cls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class Trainer:
    def __init__(self, model, max_norm=1.0):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=0.05, momentum=0.9, foreach=True)
        self.max_norm = max_norm
        self.opt_stream = torch.cuda.Stream(device=DEV)

    def train_step(self, x, y):
        cur = torch.cuda.current_stream()
        cur.wait_stream(self.opt_stream)  # join: params updated by the last step
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        # (missing: self.opt_stream.wait_stream(cur))
        with torch.cuda.stream(self.opt_stream):
            total_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
            self.opt.step()
        return loss.detach(), total_norm


def main():
    torch.manual_seed(0)
    model = ConvNet().to(DEV)
    trainer = Trainer(model)
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(128, 3, 32, 32, generator=g).to(DEV),
                torch.randint(0, 10, (128,), generator=g).to(DEV)) for _ in range(8)]
    hist = []
    for x, y in batches:
        hist.append(trainer.train_step(x, y))
    torch.cuda.synchronize()
    losses = torch.stack([h[0] for h in hist])
    norms = torch.stack([h[1] for h in hist])
    print("loss %.4f  grad-norm %.4f" % (losses[-1].item(), norms[-1].item()))


if __name__ == "__main__":
    main()
