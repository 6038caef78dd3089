# Source: sail-sg/zero-bubble-pipeline-parallelism megatron/core/weight_grad_store.py
#   (WeightGradStore.put/flush/pop: the backward of a linear layer only computes the input
#   gradient "B"; the weight-gradient GEMM "W" is queued and executed later to fill pipeline
#   bubbles, accumulating into weight.main_grad before the optimizer step).
# Pattern: one pipeline stage running a ZB-H1-like F/B/W order produced by a generator. B runs on
#   the default stream through autograd; every deferred W runs on a dedicated wgrad stream that
#   first waits for the event recorded after the matching B. After the schedule, an SGD step on
#   the default stream consumes main_grad.
import collections

import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DEV = torch.device("cuda", 0)
DIM, ROWS, LAYERS = 1024, 512, 3
N_MICRO = 4
LR = 1e-3


class WeightGradStore:
    cache = []
    queue = collections.deque()
    retired = []  # (input, grad_output) pairs stay referenced until the step has run

    @classmethod
    def put(cls, total_input, grad_output, weight):
        cls.cache.append((total_input, grad_output, weight))

    @classmethod
    def flush(cls, b_done):
        cls.queue.append((cls.cache, b_done))
        cls.cache = []

    @classmethod
    def pop(cls, wgrad_stream):
        tasks, b_done = cls.queue.popleft()
        wgrad_stream.wait_event(b_done)
        with torch.cuda.stream(wgrad_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            for total_input, grad_output, weight in tasks:
                weight.main_grad.addmm_(grad_output.t(), total_input)
        cls.retired.extend((t[0], t[1]) for t in tasks)


class SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        WeightGradStore.put(x, grad_output, weight)   # W is deferred
        grad_input = grad_output @ weight if ctx.needs_input_grad[0] else None
        return grad_input, None                        # B only


class SplitLinear(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim, device=DEV) / dim ** 0.5)
        self.weight.main_grad = torch.zeros(dim, dim, device=DEV)

    def forward(self, x):
        return SplitLinearFn.apply(x, self.weight)


def zb_h1_order(n_micro, warmup=2):
    """F/B/W order of one stage: warm-up forwards, then B, F interleaved, W filling the gaps."""
    f = b = w = 0
    for _ in range(warmup):
        yield "F", f
        f += 1
    while b < n_micro:
        yield "B", b
        b += 1
        if f < n_micro:
            yield "F", f
            f += 1
        if b - w > 1:
            yield "W", w
            w += 1
    while w < n_micro:
        yield "W", w
        w += 1


def main():
    torch.manual_seed(0)
    model = nn.Sequential(*[SplitLinear(DIM) for _ in range(LAYERS)])
    batches = [torch.randn(ROWS, DIM, device=DEV) for _ in range(N_MICRO)]

    ref = nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)]).to(DEV)
    with torch.no_grad():
        for r, m in zip(ref, model):
            r.weight.copy_(m.weight)
    for x in batches:
        torch.tanh(ref(x)).sum().backward()
    ref_weights = [r.weight.detach() - LR * r.weight.grad for r in ref]

    wgrad_stream = torch.cuda.Stream(device=DEV)

    losses = {}
    for op, mb in zb_h1_order(N_MICRO):
        if op == "F":
            losses[mb] = torch.tanh(model(batches[mb])).sum()
        elif op == "B":
            losses.pop(mb).backward()
            WeightGradStore.flush(torch.cuda.current_stream().record_event())
        else:
            WeightGradStore.pop(wgrad_stream)

    with torch.no_grad():
        for m in model:
            m.weight.add_(m.weight.main_grad, alpha=-LR)

    torch.cuda.synchronize()
    WeightGradStore.retired.clear()
    weights = [m.weight.detach() for m in model]
    checksum = sum(w.double().sum().item() for w in weights)
    reference = sum(w.double().sum().item() for w in ref_weights)
    ok = all(torch.allclose(w, r, rtol=1e-4, atol=1e-5) for w, r in zip(weights, ref_weights))
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={ok}")


if __name__ == "__main__":
    main()
