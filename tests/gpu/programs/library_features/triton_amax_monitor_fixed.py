# Source: plausible pattern. Calibration pass that records per-channel abs-max of
# every layer output (as FP8 delayed scaling / quantization calibration does, e.g.
# TransformerEngine amax history, ModelOpt calibration) with a @triton.jit reduction
# launched under torch.cuda.stream(side) so it stays off the critical path. The
# main stream only joins the side stream at the end of each batch. The record_stream
# requirement is the one in PyTorch's CUDA-semantics notes; the same allocator
# hazard was reported in meta-pytorch/torchtune#1867 and prime-rl PR #3109 review.
# FIX: act.record_stream(self.stream) after the launch, so the caching allocator
# does not recycle the activation's block until the side-stream kernel is done.
import torch
import torch.nn as nn
import triton
import triton.language as tl

DEV = torch.device("cuda", 0)


@triton.jit
def _col_absmax_kernel(x_ptr, out_ptr, n_rows, n_cols, stride_row,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < n_rows) & col_mask[None, :]
        v = tl.load(x_ptr + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.max(tl.abs(v), axis=0))
    tl.store(out_ptr + cols, acc, mask=col_mask)


class AmaxMonitor:
    def __init__(self, n_layers: int, width: int):
        self.stream = torch.cuda.Stream(device=DEV)
        self.batch_amax = torch.zeros(n_layers, width, device=DEV)
        self.amax_history = torch.zeros(n_layers, width, device=DEV)

    def observe(self, idx: int, act: torch.Tensor):
        n_rows, n_cols = act.shape
        self.stream.wait_stream(torch.cuda.current_stream())   # act is fully written
        with torch.cuda.stream(self.stream):
            grid = (triton.cdiv(n_cols, 128),)
            _col_absmax_kernel[grid](act, self.batch_amax[idx], n_rows, n_cols,
                                     act.stride(0), BLOCK_M=32, BLOCK_N=128)
        act.record_stream(self.stream)

    def finish_batch(self) -> float:
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.maximum(self.amax_history, self.batch_amax, out=self.amax_history)
        return self.amax_history.max().item()


class Net(nn.Module):
    def __init__(self, width=1024, n_layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n_layers))

    def forward(self, h, monitor=None):
        for i, layer in enumerate(self.layers):
            h = torch.relu_(layer(h))
            if monitor is not None:
                monitor.observe(i, h)
        return h


def main():
    torch.manual_seed(0)
    model = Net().to(DEV)
    monitor = AmaxMonitor(len(model.layers), 1024)
    torch.cuda.synchronize()
    with torch.no_grad():
        for batch in range(3):
            x = torch.randn(4096, 1024, device=DEV)
            model(x, monitor)
            amax = monitor.finish_batch()
            print(f"batch {batch}: running amax {amax:.4f}")


if __name__ == "__main__":
    main()
