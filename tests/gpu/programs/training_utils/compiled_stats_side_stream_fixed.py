# Case: compiled_stats_side_stream (FIXED version)
# Source: plausible pattern. Inductor's generated wrapper launches its Triton kernels on
# get_raw_stream(device) == the caller's *current* stream, so a torch.compile'd function
# (default mode, no CUDA graphs) called inside `with torch.cuda.stream(side)` runs on
# `side` and needs the same fork/join edges as eager code; cf. pytorch/pytorch issue
# #185546, whose fn_with_workaround shows side.wait_stream(current_stream()) before the
# side-stream region. Here a training loop computes activation statistics (a "monitor"
# callback) with a compiled function on a side stream to keep it off the critical path.
# Fix: stat_stream.wait_stream(default) before calling the compiled function, so its
# kernels read the features only after the backbone has written them.
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
import torch.nn.functional as F

inductor_config.compile_threads = 1  # keep compilation in-process (small graph)
DEV = torch.device("cuda:0")


def feature_stats(feats, w):
    z = feats * w
    return torch.stack([z.mean(), z.pow(2).mean(), (z > 0).float().mean(), z.abs().amax()])


class ActivationMonitor:
    def __init__(self, dim):
        self.stream = torch.cuda.Stream(device=DEV)
        self.w = torch.ones(dim, device=DEV)
        self.acc = torch.zeros(4, device=DEV)
        self.n = 0
        self.compiled = torch.compile(feature_stats)  # default mode

    @torch.no_grad()
    def observe(self, feats):
        self.stream.wait_stream(torch.cuda.current_stream())  # FIX: fork edge
        with torch.cuda.stream(self.stream):
            s = self.compiled(feats, self.w)  # Triton kernels launched on self.stream
            self.acc.add_(s)
        self.n += 1
        # join so the caller may free / reuse `feats` afterwards
        torch.cuda.current_stream().wait_stream(self.stream)

    def summary(self):
        torch.cuda.synchronize()
        return (self.acc / max(self.n, 1)).tolist()


class Model(nn.Module):
    def __init__(self, d=512, h=2048, n_cls=50):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU())
        self.head = nn.Linear(h, n_cls)

    def forward(self, x):
        feats = self.backbone(x)
        return feats, self.head(feats)


def main():
    torch.manual_seed(0)
    model = Model().to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    monitor = ActivationMonitor(2048)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(512, 512, generator=g).to(DEV),
             torch.randint(0, 50, (512,), generator=g).to(DEV)) for _ in range(6)]
    torch.cuda.synchronize()  # setup done
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        feats, logits = model(x)  # feats written on the default stream
        monitor.observe(feats.detach())
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
    print("activation stats", ["%.4f" % v for v in monitor.summary()])


if __name__ == "__main__":
    main()
