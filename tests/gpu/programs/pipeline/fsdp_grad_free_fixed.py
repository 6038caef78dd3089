# Source: pytorch/pytorch torch/distributed/fsdp/_runtime_utils.py::_post_backward_hook
#   (the unsharded gradient is handed to the post-backward stream, `flat_param.grad = None`
#   frees it so the next backward starts fresh, and "Since the unsharded gradient is produced in
#   the computation stream and consumed in the post-backward stream, inform the caching
#   allocator (before it goes out of scope)" via _no_dispatch_record_stream).
# Pattern: gradient accumulation over micro-batches; every parameter's post-accumulate-grad hook
#   moves the fresh gradient to a side "post-backward" stream, pre-divides it and accumulates
#   this rank's shard (reduce-scatter stand-in), then drops .grad.
import copy

import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DEV = torch.device("cuda", 0)
WORLD, RANK = 4, 1
DIM, ROWS, LAYERS = 1024, 1024, 3
N_MICRO = 3


class ShardedGradReducer:
    def __init__(self, params):
        self.post_backward = torch.cuda.Stream(device=DEV)
        self.shards = {p: torch.zeros(p.numel() // WORLD, device=DEV) for p in params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._post_backward_hook)
        self.post_backward.wait_stream(torch.cuda.current_stream())  # shards were zero-filled

    @torch.no_grad()
    def _post_backward_hook(self, param):
        # gradient computation for this parameter is done on the current stream
        self.post_backward.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.post_backward):
            unsharded = param.grad
            param.grad = None  # free .grad so the next micro-batch's backward starts fresh
            torch.cuda._sleep(SLEEP_CYCLES)  # reduce-scatter still queued behind earlier ones
            predivided = unsharded.div(WORLD)
            self.shards[param].add_(predivided.view(WORLD, -1)[RANK])
            # FIX: the gradient block was allocated on the compute stream and is read here
            unsharded.record_stream(self.post_backward)

    def wait(self):
        torch.cuda.current_stream().wait_stream(self.post_backward)


def build_model():
    return nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)]).to(DEV)


def main():
    torch.manual_seed(0)
    model = build_model()
    ref_model = copy.deepcopy(model)
    batches = [torch.randn(ROWS, DIM, device=DEV) for _ in range(N_MICRO)]

    for x in batches:
        torch.tanh(ref_model(x)).sum().backward()
    reference_shards = [(p.grad / WORLD).view(WORLD, -1)[RANK] for p in ref_model.parameters()]

    params = list(model.parameters())
    reducer = ShardedGradReducer(params)
    for x in batches:
        loss = torch.tanh(model(x)).sum()
        loss.backward()
    reducer.wait()

    torch.cuda.synchronize()
    shards = [reducer.shards[p] for p in params]
    checksum = sum(s.double().sum().item() for s in shards)
    reference = sum(s.double().sum().item() for s in reference_shards)
    ok = all(torch.allclose(s, r, rtol=1e-3, atol=1e-4) for s, r in zip(shards, reference_shards))
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={ok}")


if __name__ == "__main__":
    main()
