# Source: microsoft/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py: per-parameter gradient hooks
#   (create_reduce_and_remove_grad_hooks -> reduce_independent_p_g_buckets_and_remove_grads) copy each grad
#   into the contiguous ipg_buffer, and with overlap_comm the work runs on self.reduction_stream, which
#   average_tensor() first orders with reduction_stream.wait_stream(current_stream()). The fp16 overflow
#   check (CheckOverflow / has_overflow) then decides whether optimizer.step() is skipped.
#   Bug: the hook enqueues the copy on the reduction stream without waiting for the backward kernels on
#   the compute stream that write the gradient.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms: the backward pass is still queued behind earlier compute work
DEVICE = torch.device("cuda", 0)
NUM_STEPS = 6
OVERFLOW_STEP = 2  # the loss is scaled to inf at this step: the overflow check must skip it


class ZeroStyleOptimizer:
    def __init__(self, model, lr):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.lr = lr
        self.reduction_stream = torch.cuda.Stream()
        self.offsets = {}
        offset = 0
        for p in self.params:
            self.offsets[id(p)] = offset
            offset += p.numel()
            p.register_post_accumulate_grad_hook(self._reduce_ready_partition)
        self.ipg_buffer = torch.zeros(offset, device=DEVICE)
        self.overflow = torch.zeros((), dtype=torch.bool, device=DEVICE)
        self.mismatch_count = torch.zeros((), device=DEVICE)
        self.skipped_steps = 0

    def _reduce_ready_partition(self, param):
        # Runs from autograd as soon as param.grad has been accumulated (enqueued) on the compute stream.
        offset = self.offsets[id(param)]
        with torch.cuda.stream(self.reduction_stream):
            self.ipg_buffer[offset:offset + param.numel()].copy_(param.grad.view(-1))

    @torch.no_grad()
    def step(self):
        with torch.cuda.stream(self.reduction_stream):
            self.overflow.copy_(~torch.isfinite(self.ipg_buffer).all())
        compute_stream = torch.cuda.current_stream()
        compute_stream.wait_stream(self.reduction_stream)
        flat_grads = torch.cat([p.grad.view(-1) for p in self.params])
        same = (self.ipg_buffer == flat_grads) | (torch.isnan(self.ipg_buffer) & torch.isnan(flat_grads))
        self.mismatch_count += (~same).sum()
        if self.overflow.item():
            self.skipped_steps += 1
        else:
            for p in self.params:
                p.add_(p.grad, alpha=-self.lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256)).to(DEVICE)
    optimizer = ZeroStyleOptimizer(model, lr=1e-3)
    data = [(torch.randn(512, 1024, device=DEVICE), torch.randn(512, 256, device=DEVICE)) for _ in range(NUM_STEPS)]
    torch.cuda.synchronize()

    for step, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y)
        if step == OVERFLOW_STEP:
            loss = loss * float("inf")
        torch.cuda._sleep(SLEEP_CYCLES)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    torch.cuda.synchronize()
    mismatches = int(optimizer.mismatch_count.item())
    params_finite = all(bool(torch.isfinite(p).all().item()) for p in model.parameters())
    checksum = mismatches + 1000 * optimizer.skipped_steps
    reference = 1000
    match = checksum == reference and params_finite
    print(f"checksum={checksum} reference={reference} match={match}")


if __name__ == "__main__":
    main()
