# Case: swa_update_side_stream (BUG version)
# Source: torch.optim.swa_utils.AveragedModel.update_parameters (real library code:
# copy_ on the first call, then get_swa_multi_avg_fn -> torch._foreach_lerp_, all on the
# current stream). Running it "in the background" on a CUDA stream follows the idea in
# pytorch/pytorch PR #94820 (asynchronous EMA/SWA on a CUDA stream). The stream wiring
# is a plausible pattern, not a specific buggy file.
# Bug: the SWA stream is joined back before the next optimizer.step() (so no WAR), but
# the fork is missing: update_parameters() on swa_stream reads the model parameters that
# optimizer.step() has just written on the default stream, with no
# swa_stream.wait_stream(default) in between (RAW race).
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import SWALR, AveragedModel

DEV = torch.device("cuda:0")


class Regressor(nn.Module):
    def __init__(self, d=256, h=1024):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.LayerNorm(h),
                                 nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


class BackgroundSWA:
    def __init__(self, model):
        self.swa_model = AveragedModel(model)  # SWA running average (n_averaged on CPU)
        self.stream = torch.cuda.Stream(device=DEV)

    def before_optimizer_step(self):
        # the next in-place optimizer update must not overwrite weights still being averaged
        torch.cuda.current_stream().wait_stream(self.stream)

    def update(self, model):
        # (missing: self.stream.wait_stream(torch.cuda.current_stream()))
        with torch.cuda.stream(self.stream):
            self.swa_model.update_parameters(model)


def main():
    torch.manual_seed(0)
    model = Regressor().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    swa = BackgroundSWA(model)
    swa_sched = SWALR(opt, swa_lr=0.01, anneal_epochs=2)
    g = torch.Generator().manual_seed(11)
    data = [(torch.randn(512, 256, generator=g).to(DEV), torch.randn(512, generator=g).to(DEV))
            for _ in range(8)]
    torch.cuda.synchronize()  # setup done
    swa_start = 2
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        swa.before_optimizer_step()
        opt.step()
        if step >= swa_start:
            swa.update(model)  # reads the weights written by opt.step() just above
            swa_sched.step()
    torch.cuda.current_stream().wait_stream(swa.stream)
    with torch.no_grad():
        err = F.mse_loss(swa.swa_model(data[0][0]), data[0][1])
    print("swa eval loss %.4f (n_averaged=%d)" % (err.item(), int(swa.swa_model.n_averaged)))


if __name__ == "__main__":
    main()
