# Source: allenai/OLMo-core src/olmo_core/nn/moe/utils.py, async_copy_to_cpu(): the per-expert token counts
#   (batch_size_per_expert) are copied to pinned memory on a dedicated dtoh stream after
#   dtoh_stream.wait_stream(current_stream()), an event is recorded, and the host later waits on it to
#   get the grouped-GEMM split sizes. The line `gpu_buf.record_stream(dtoh_stream)` is commented out there
#   ("does not work with compile"), so the caller dropping gpu_buf frees its block back to the compute
#   stream's pool while the dtoh stream may still be reading it.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms: the dtoh stream is still busy with earlier transfers
DEVICE = torch.device("cuda", 0)
NUM_EXPERTS = 96
HIDDEN = 256
TOKENS = 4096
NUM_LAYERS = 2
NUM_STEPS = 3


def async_copy_to_cpu(gpu_buf, dtoh_stream):
    dtoh_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(dtoh_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        cpu_buf = torch.empty_like(gpu_buf, device="cpu", pin_memory=True)
        cpu_buf.copy_(gpu_buf, non_blocking=True)
    dtoh_event = dtoh_stream.record_event()
    return cpu_buf, dtoh_event


class MoELayer(nn.Module):
    def __init__(self, dtoh_stream):
        super().__init__()
        self.router = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN) / HIDDEN**0.5)
        self.dtoh_stream = dtoh_stream
        self.routing_log = []  # (device end offsets per expert, split sizes seen on the host)
        self.bad_splits = 0

    def _route(self, x):
        expert_ids = self.router(x).argmax(dim=-1)
        batch_size_per_expert = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=DEVICE)
        batch_size_per_expert.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        counts_cpu, dtoh_event = async_copy_to_cpu(batch_size_per_expert, self.dtoh_stream)
        return expert_ids, counts_cpu, dtoh_event  # the device counts tensor is dropped here

    def forward(self, x):
        expert_ids, counts_cpu, dtoh_event = self._route(x)
        # Device work that overlaps the D2H copy: per-expert end offsets into the sorted token order
        # (for the combine step), then the token permutation itself.
        expert_end = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=DEVICE)
        expert_end.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        expert_end.cumsum_(0)
        order = torch.argsort(expert_ids, stable=True)
        x_sorted = x[order]
        # The grouped GEMM needs the split sizes on the host.
        dtoh_event.synchronize()
        splits = counts_cpu.tolist()
        self.routing_log.append((expert_end, splits))
        if sum(splits) != x.shape[0] or min(splits) < 0:
            self.bad_splits += 1  # unusable split sizes: drop this layer's expert update
            return x
        outs = []
        for e, chunk in enumerate(torch.split(x_sorted, splits)):
            if chunk.numel():
                outs.append(chunk @ self.experts[e])
        y = torch.empty_like(x)
        y[order] = torch.cat(outs)
        return x + y


def main():
    torch.manual_seed(0)
    dtoh_stream = torch.cuda.Stream()
    layers = nn.ModuleList([MoELayer(dtoh_stream) for _ in range(NUM_LAYERS)]).to(DEVICE)
    inputs = [torch.randn(TOKENS, HIDDEN, device=DEVICE) for _ in range(NUM_STEPS)]
    torch.cuda.synchronize()

    with torch.no_grad():
        for x in inputs:
            for layer in layers:
                x = layer(x)

    torch.cuda.synchronize()
    checksum = 0
    reference = 0
    ok = True
    for layer in layers:
        for expert_end, splits in layer.routing_log:
            true_counts = torch.diff(expert_end, prepend=expert_end.new_zeros(1)).tolist()
            ok = ok and splits == true_counts
            checksum += sum(i * c for i, c in enumerate(splits))
            reference += sum(i * c for i, c in enumerate(true_counts))
    print(f"checksum={checksum} reference={reference} match={ok}")


if __name__ == "__main__":
    main()
