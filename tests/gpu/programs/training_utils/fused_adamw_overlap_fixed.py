# Case: fused_adamw_overlap (FIXED version)
# Source: plausible pattern. Modeled on "optimizer overlap" designs where the optimizer
# runs on its own stream, e.g. pytorch/pytorch PR #89963
# (torch/distributed/algorithms/ddp_comm_hooks/optimizer_overlap_hooks.py: the main
# stream must wait_stream(optim_stream) before the next forward). Here a hand-written
# trainer steps a fused AdamW on a side stream so that the step overlaps with the host
# preparing the next batch, but it forgets the join before the next forward.
# Fix: the default stream waits for opt_stream at the start of every step, so the
# forward sees the updated parameters and backward sees the zeroed .grad buffers.
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class MLP(nn.Module):
    def __init__(self, d=1024, h=4096):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class OverlappedTrainer:
    def __init__(self, model, lr=1e-3):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
        self.opt_stream = torch.cuda.Stream(device=DEV)

    def train_step(self, x, y):
        # FIX: join the optimizer stream before touching params / grads again
        torch.cuda.current_stream().wait_stream(self.opt_stream)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = self.model(x)  # reads params written by the previous step on opt_stream
        loss = F.mse_loss(out.float(), y)
        loss.backward()  # accumulates into .grad zeroed on opt_stream
        # the optimizer stream must see the gradients produced by backward
        self.opt_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.opt_stream):
            self.opt.step()
            # keep .grad buffers persistent (no realloc each step)
            self.opt.zero_grad(set_to_none=False)
        return loss.detach()


def main():
    torch.manual_seed(0)
    model = MLP().to(DEV)
    trainer = OverlappedTrainer(model)
    g = torch.Generator(device="cpu").manual_seed(1)
    xs = [torch.randn(256, 1024, generator=g).to(DEV) for _ in range(8)]
    ys = [torch.randn(256, 1024, generator=g).to(DEV) for _ in range(8)]
    losses = []
    for step in range(8):
        losses.append(trainer.train_step(xs[step], ys[step]))
    torch.cuda.synchronize()
    print("final loss %.4f" % torch.stack(losses)[-1].item())


if __name__ == "__main__":
    main()
