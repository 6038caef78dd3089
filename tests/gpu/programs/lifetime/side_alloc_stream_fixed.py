"""side_alloc_stream (fixed version).

Plausible pattern, no specific issue: FP8 "delayed scaling" calibration (amax history ->
scale, as kept by NVIDIA TransformerEngine) computed on a side stream so that it overlaps the
MLP's down-projection GEMM.  The allocator rule it trips over is the one documented for
Tensor.record_stream / "CUDA semantics": a freed block belongs to the stream that allocated
it and is handed to that stream's next allocation without further synchronization.

The hidden activation `h` is allocated on the default stream, read on the side stream and then
freed.  Side-stream allocations after the free cannot receive h's block; the next
default-stream allocation can.

Fix: the default stream waits for the side stream before its next allocation (no
record_stream needed); h is still freed while the side stream may be running.
"""
import torch

DEV = torch.device("cuda", 0)
N, D, H = 4096, 1024, 4096          # hidden activation 4096 x 4096 fp32 = 64 MiB
STEPS, HIST = 4, 16


class AmaxCalibrator:
    def __init__(self):
        self.stream = torch.cuda.Stream(DEV)
        self.history = torch.zeros(HIST, H, device=DEV)
        self.scale = torch.ones(H, device=DEV)
        self.step = 0

    def observe(self, h):
        self.stream.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(self.stream):
            amax = h.amax(dim=0)                          # side stream reads h
            self.history[self.step % HIST].copy_(amax)
        self.step += 1

    def update_scale(self):
        with torch.cuda.stream(self.stream):
            amax = self.history.amax(dim=0).clamp_(min=1e-6)    # side-stream allocations
            self.scale.copy_(448.0 / amax)


@torch.no_grad()
def mlp_step(x, w_up, w_down, calib):
    cur = torch.cuda.current_stream(DEV)
    h = torch.matmul(x, w_up).relu_()               # [N, H], allocated on the default stream
    calib.observe(h)
    y = torch.matmul(h, w_down)                     # [N, D]
    del h                                           # last reference: block back to default's pool
    calib.update_scale()                            # side stream allocates (cannot get h's block)
    # FIX: join the calibration stream before the default stream allocates again; h's block is
    # then only handed out after everything the side stream did with it.
    cur.wait_stream(calib.stream)                   # join the calibration stream
    z = torch.matmul(y, w_up).relu_()               # default stream allocates 64 MiB
    return (z.mean(dim=0) * calib.scale).sum()


def main():
    torch.manual_seed(0)
    w_up = torch.randn(D, H, device=DEV).div_(D ** 0.5)
    w_down = torch.randn(H, D, device=DEV).div_(H ** 0.5)
    xs = [torch.randn(N, D, device=DEV) for _ in range(STEPS)]
    calib = AmaxCalibrator()
    outs = [mlp_step(x, w_up, w_down, calib) for x in xs]
    torch.cuda.synchronize()
    print("out", round(torch.stack(outs).sum().item(), 3), "scale", round(calib.scale.mean().item(), 3))


if __name__ == "__main__":
    main()
