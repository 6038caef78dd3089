# transitive_chain_free (FIXED version)
# Source: three-stage stream pipeline of pytorch/torchrec
# torchrec/distributed/train_pipeline (memcpy stream -> data_dist stream ->
# default stream, joined with current_stream().wait_stream(...)); streams are
# switched with torch.cuda.set_stream() + manual restore as in vLLM-style
# helpers. Enqueuing the side statistics after the fork is a plausible pattern,
# not a specific reported issue.
# Semantics: wait_stream is transitive only for work enqueued BEFORE each wait:
# main.wait_stream(dist) covers memcpy-stream work enqueued before
# dist.wait_stream(memcpy), but not memcpy-stream work enqueued after it.
import torch

torch.manual_seed(0)
DEV = torch.device("cuda:0")
ROWS, COLS, STEPS = 4096, 1024, 6                    # x is 16 MiB: its own segment


def run_on(stream, fn, *args):
    prev = torch.cuda.current_stream()
    torch.cuda.set_stream(stream)
    try:
        return fn(*args)
    finally:
        torch.cuda.set_stream(prev)


class ThreeStagePipeline:
    def __init__(self):
        self.memcpy = torch.cuda.Stream()             # stage 1 (C)
        self.dist = torch.cuda.Stream()               # stage 2 (B)
        self.scale = torch.rand(COLS, device=DEV) + 0.5
        self.packed = torch.empty(ROWS, COLS, device=DEV)
        self.routed = torch.empty(ROWS, COLS, device=DEV)
        self.amax_hist = torch.zeros(STEPS, device=DEV)

    def _pack(self, x):
        torch.mul(x, self.scale, out=self.packed)     # reads x on memcpy stream

    def _stats(self, x, step):
        self.amax_hist[step].copy_(x.abs().amax())    # reads x on memcpy stream

    def _route(self):
        torch.add(self.packed, 1.0, out=self.routed)

    def stage1(self, x):
        self.memcpy.wait_stream(torch.cuda.current_stream())
        run_on(self.memcpy, self._pack, x)

    def stage2(self):
        self.dist.wait_stream(self.memcpy)
        run_on(self.dist, self._route)

    def record_stats(self, x, step):
        run_on(self.memcpy, self._stats, x, step)


def main():
    pipe = ThreeStagePipeline()
    model = torch.nn.Linear(COLS, 256).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    main_stream = torch.cuda.current_stream()
    total = torch.zeros((), device=DEV)
    for step in range(STEPS):
        x = torch.randn(ROWS, COLS, device=DEV)       # allocated on main
        pipe.stage1(x)
        # FIX: enqueue the statistics before dist forks from the memcpy stream;
        # main -> dist -> memcpy then covers every read of x before it is freed.
        pipe.record_stats(x, step)
        pipe.stage2()
        main_stream.wait_stream(pipe.dist)            # main -> dist -> memcpy
        loss = model(pipe.routed).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.detach()
        del x                                         # freed, no record_stream
    torch.cuda.synchronize()
    print("loss", total.item() / STEPS, "amax", pipe.amax_hist.tolist())


if __name__ == "__main__":
    main()
