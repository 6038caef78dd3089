# Optimizer step fused into the backward pass, running on a side "optimizer stream" (BUG version).
# Source: pytorch/pytorch torch/distributed/algorithms/ddp_comm_hooks/optimizer_overlap_hooks.py
#   (_apply_optim_in_backward_hook + _OptimInBackwardHookState, used by DDP with
#   torch.distributed.optim._apply_optimizer_in_backward): per-parameter optimizers step on
#   optim_stream inside the gradient hook, and a callback queued once per backward
#   (Variable._execution_engine.queue_callback) makes the current stream wait for optim_stream
#   and sets the grads to None.  The callback must also reset wait_for_optim_stream_enqueued;
#   this version forgets that reset (plausible variant of the real code), so from the second
#   backward on no callback is queued and nothing orders the optimizer stream's parameter
#   updates before the next forward (nor its grad reads before the next backward).
# Without DDP here (single GPU): the hook runs after AccumulateGrad, and optim_stream waits for
# the current stream where the real hook waited on the all-reduce future.
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.autograd import Variable

DEV = torch.device("cuda:0")


@dataclass
class _OptimInBackwardHookState:
    optim_stream: torch.cuda.Stream
    wait_for_optim_stream_enqueued: bool


def _apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs):
    for param in params:
        param._in_backward_optimizers = [optimizer_class([param], **optimizer_kwargs)]


def apply_optim_in_backward_hook(param, optim_stream_state, model, world_size=1):
    optimizer_stream = optim_stream_state.optim_stream
    optimizer_stream.wait_stream(torch.cuda.current_stream())   # grad is ready (fut.wait())
    with torch.cuda.stream(optimizer_stream):
        param.grad.div_(world_size)                              # all-reduce average
        for optim in param._in_backward_optimizers:
            optim.step()

    # enqueue a callback to wait for this optimizer stream at the end of
    # backward and set all managed grads to None.
    def wait_for_optim_stream_callback():
        torch.cuda.current_stream().wait_stream(optim_stream_state.optim_stream)
        for p in model.parameters():
            if hasattr(p, "_in_backward_optimizers"):
                p.grad = None

    if not optim_stream_state.wait_for_optim_stream_enqueued:
        Variable._execution_engine.queue_callback(wait_for_optim_stream_callback)
        # mark that the callback is enqueued
        optim_stream_state.wait_for_optim_stream_enqueued = True


class MLP(nn.Module):
    def __init__(self, d=512):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 10))

    def forward(self, x):
        return self.net(x)


def main():
    torch.manual_seed(0)
    model = MLP().to(DEV)
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.01, "momentum": 0.9})
    state = _OptimInBackwardHookState(optim_stream=torch.cuda.Stream(), wait_for_optim_stream_enqueued=False)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(partial(apply_optim_in_backward_hook,
                                                     optim_stream_state=state, model=model))
    losses = []
    for step in range(5):
        x = torch.randn(128, 512, device=DEV)
        y = torch.randint(0, 10, (128,), device=DEV)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()   # parameters are updated inside backward; no optimizer.step() here
        losses.append(loss.detach())
    torch.cuda.synchronize()
    print("losses", [round(v.item(), 4) for v in losses])


if __name__ == "__main__":
    main()
