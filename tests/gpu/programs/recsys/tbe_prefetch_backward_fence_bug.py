# Source: pytorch/FBGEMM fbgemm_gpu/fbgemm_gpu/split_table_batched_embeddings_ops_training.py
#   (prefetch_pipeline=True: placeholder_autograd_tensor.register_hook(self._sync_stream_post_backward),
#   whose docstring says backward(batch_i) writes UVM memory while a later prefetch loads UVM rows into
#   the cache, so prefetch_stream.wait_stream(current_stream) is issued after the TBE backward) and
#   pytorch/FBGEMM PR #1893 "TBE UVM cache prefetch pipeline".
"""Table-batched embedding with a UVM-resident table, a prefetch stream that gathers the rows of the
next batch into a scratch pad, and a fused SGD update applied to the UVM rows inside the autograd
backward (no separate optimizer step), as FBGEMM's TBE does."""
from collections import deque

import torch

SLEEP_CYCLES = 20_000_000
DEV = torch.device("cuda", 0)
NUM_ROWS, DIM, B, BAG, LR, ITERS = 512, 64, 256, 16, 20.0, 6


class _TBELookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, tbe, rows, scratch_pad):
        ctx.tbe = tbe
        ctx.save_for_backward(rows)
        return scratch_pad.view(-1, BAG, DIM).sum(1)

    @staticmethod
    def backward(ctx, grad_out):
        (rows,) = ctx.saved_tensors
        tbe = ctx.tbe
        grad_rows = grad_out.unsqueeze(1).expand(-1, BAG, DIM).reshape(-1, DIM)
        # the fused optimizer kernel is queued behind the dense backward
        torch.cuda._sleep(SLEEP_CYCLES)
        tbe.uvm_weights.index_add_(0, rows, grad_rows, alpha=-LR)
        return grad_out.new_zeros(0), None, None, None


class PrefetchedUVMEmbedding:
    def __init__(self, weights):
        self.uvm_weights = weights  # EmbeddingLocation.MANAGED in FBGEMM
        self.compute_stream = torch.cuda.current_stream()
        self.prefetch_stream = torch.cuda.Stream()
        self.placeholder_autograd_tensor = torch.zeros(0, device=DEV, requires_grad=True)
        self._inflight = deque()  # (rows, scratch_pad) per prefetched batch
        self._backward_calls = 0
        self.placeholder_autograd_tensor.register_hook(self._sync_stream_post_backward)

    def _sync_stream_post_backward(self, grad):
        # runs right after the TBE backward of the current batch
        self._backward_calls += 1
        self._inflight.popleft()

    def prefetch(self, rows):
        with torch.cuda.stream(self.prefetch_stream):
            scratch_pad = self.uvm_weights.index_select(0, rows)
        self._inflight.append((rows, scratch_pad))

    def __call__(self, rows):
        prefetched_rows, scratch_pad = self._inflight[0]
        assert prefetched_rows is rows
        self.compute_stream.wait_stream(self.prefetch_stream)
        scratch_pad.record_stream(self.compute_stream)
        return _TBELookup.apply(self.placeholder_autograd_tensor, self, rows, scratch_pad)


def reference(weights, batches, targets):
    w = weights.clone()
    losses = []
    for rows, target in zip(batches, targets):
        pad = w.index_select(0, rows).requires_grad_()
        loss = ((pad.view(-1, BAG, DIM).sum(1) - target) ** 2).mean()
        (g,) = torch.autograd.grad(loss, pad)
        w.index_add_(0, rows, g, alpha=-LR)
        losses.append(loss.detach())
    return torch.stack(losses), w


def main():
    torch.manual_seed(0)
    weights0 = torch.randn(NUM_ROWS, DIM, device=DEV) * 0.1
    batches = [torch.randint(0, NUM_ROWS, (B * BAG,), device=DEV) for _ in range(ITERS)]
    targets = [torch.randn(B, DIM, device=DEV) for _ in range(ITERS)]
    tbe = PrefetchedUVMEmbedding(weights0.clone())
    torch.cuda.synchronize()

    losses = []
    tbe.prefetch(batches[0])
    for i in range(ITERS):
        pooled = tbe(batches[i])
        loss = ((pooled - targets[i]) ** 2).mean()
        loss.backward()
        if i + 1 < ITERS:
            # prefetch of batch i+1 overlaps with the tail of iteration i
            tbe.prefetch(batches[i + 1])
        losses.append(loss.detach())
    got = torch.stack(losses)
    torch.cuda.synchronize()

    ref_losses, ref_w = reference(weights0, batches, targets)
    torch.cuda.synchronize()
    match = (torch.allclose(got, ref_losses, rtol=1e-4, atol=1e-5)
             and torch.allclose(tbe.uvm_weights, ref_w, rtol=1e-4, atol=1e-5))
    checksum, ref_checksum = tbe.uvm_weights.sum().item(), ref_w.sum().item()
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={ref_checksum:.6f} match={match}")


if __name__ == "__main__":
    main()
