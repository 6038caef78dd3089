# Source: pytorch/pytorch torch/distributed/algorithms/ddp_comm_hooks/optimizer_overlap_hooks.py
#   (_apply_optim_in_backward_hook: the optimizer step runs on optim_stream inside a backward hook and
#   Variable._execution_engine.queue_callback(wait_for_optim_stream_callback) makes the current stream
#   wait for optim_stream at the end of backward; the callback resets wait_for_optim_stream_enqueued
#   "for the next backward pass"), applied to a row-wise Adagrad sparse optimizer as in FBGEMM/torchrec.
"""Optimizer-in-backward for an embedding table: a post-accumulate-grad hook runs a row-wise Adagrad
update on a side stream as soon as the table gradient is ready, and an autograd engine callback makes
the compute stream wait for that update before the next forward."""
import torch
import torch.nn.functional as F
from torch.autograd.variable import Variable

SLEEP_CYCLES = 20_000_000
DEV = torch.device("cuda", 0)
NUM_ROWS, DIM, B, BAG, ITERS, LR, EPS = 2048, 64, 512, 8, 5, 0.5, 1e-8


def rowwise_adagrad_(param, grad, sum_sq):
    sum_sq.add_(grad.pow(2).mean(dim=1))
    scale = LR / (sum_sq.sqrt() + EPS)
    param.addcmul_(grad, scale.unsqueeze(1), value=-1.0)


class RowWiseAdagradInBackward:
    def __init__(self, table):
        self.compute_stream = torch.cuda.current_stream()
        self.optim_stream = torch.cuda.Stream()
        self.sum_sq = torch.zeros(table.shape[0], device=DEV)
        self.wait_for_optim_stream_enqueued = False
        table.register_post_accumulate_grad_hook(self._step_in_backward)

    def _step_in_backward(self, param):
        grad = param.grad
        self.optim_stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(self.optim_stream), torch.no_grad():
            # the optimizer stream is still busy with the previous step's state bookkeeping
            torch.cuda._sleep(SLEEP_CYCLES)
            rowwise_adagrad_(param, grad, self.sum_sq)
        grad.record_stream(self.optim_stream)
        param.grad = None
        if not self.wait_for_optim_stream_enqueued:
            Variable._execution_engine.queue_callback(self._wait_for_optim_stream)
            self.wait_for_optim_stream_enqueued = True

    def _wait_for_optim_stream(self):
        self.compute_stream.wait_stream(self.optim_stream)
        # FIX: reset so that the next backward pass enqueues this wait again
        self.wait_for_optim_stream_enqueued = False


def loss_fn(table, proj, ids, labels):
    pooled = table.index_select(0, ids).view(-1, BAG, DIM).sum(1)
    return F.binary_cross_entropy_with_logits(pooled @ proj, labels)


def reference(table0, proj, batches):
    table = table0.clone()
    sum_sq = torch.zeros(NUM_ROWS, device=DEV)
    losses = []
    for ids, labels in batches:
        t = table.detach().requires_grad_()
        loss = loss_fn(t, proj, ids, labels)
        (grad,) = torch.autograd.grad(loss, t)
        with torch.no_grad():
            rowwise_adagrad_(table, grad, sum_sq)
        losses.append(loss.detach())
    return torch.stack(losses), table


def main():
    torch.manual_seed(0)
    table0 = torch.randn(NUM_ROWS, DIM, device=DEV) * 0.1
    proj = torch.randn(DIM, device=DEV)
    batches = [(torch.randint(0, NUM_ROWS, (B * BAG,), device=DEV),
                torch.randint(0, 2, (B,), device=DEV).float()) for _ in range(ITERS)]
    table = torch.nn.Parameter(table0.clone())
    RowWiseAdagradInBackward(table)
    torch.cuda.synchronize()

    losses = []
    for ids, labels in batches:
        loss = loss_fn(table, proj, ids, labels)
        loss.backward()
        losses.append(loss.detach())
    got = torch.stack(losses)
    torch.cuda.synchronize()

    ref_losses, ref_table = reference(table0, proj, batches)
    torch.cuda.synchronize()
    match = (torch.allclose(got, ref_losses, rtol=1e-4, atol=1e-5)
             and torch.allclose(table.detach(), ref_table, rtol=1e-4, atol=1e-5))
    checksum, ref_checksum = table.detach().sum().item(), ref_table.sum().item()
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={ref_checksum:.6f} match={match}")


if __name__ == "__main__":
    main()
