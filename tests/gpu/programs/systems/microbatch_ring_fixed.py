"""Micro-batch inference pipeline over three streams: the H2D copy of
micro-batch t+1, the compute of t and the D2H copy of t-1 overlap, using a ring
of NUM_SLOTS device input/output buffers and pinned output buffers; the host
consumes results two steps behind the compute.

Modeled on: pytorch/FBGEMM PR #5512 (double-buffered eviction buffers: an
iteration may only reuse a buffer once the consumer two iterations back is
done, so ring depth must match the consumer lag) and vllm-project/vllm PR #29941
(StaticBufferPool with slot_capacity = prefetch_step).  Plausible pattern, no
single upstream bug.

FIXED: NUM_SLOTS = 3.  The H2D stream is never ordered after the compute
stream directly; an input slot is free once the host has synchronized the D2H
of micro-batch t-2 (which waited for compute(t-2)), and with 3 slots H2D(t+1)
reuses exactly the slot of micro-batch t-2.
"""
import torch

DEV = torch.device("cuda:0")
N_MICRO = 8
MB, D_IN, D_HID, D_OUT = 256, 1024, 2048, 1024
NUM_SLOTS = 3  # lag-2 consumer: slots = lag + 1


class Pipeline:
    def __init__(self, model, num_slots):
        self.model = model
        self.R = num_slots
        self.h2d = torch.cuda.Stream(device=DEV)
        self.comp = torch.cuda.Stream(device=DEV)
        self.d2h = torch.cuda.Stream(device=DEV)
        self.dev_in = [torch.empty(MB, D_IN, device=DEV) for _ in range(self.R)]
        self.dev_out = [torch.empty(MB, D_OUT, device=DEV) for _ in range(self.R)]
        self.host_out = [torch.empty(MB, D_OUT, pin_memory=True) for _ in range(self.R)]
        self.h2d_done = [torch.cuda.Event() for _ in range(self.R)]
        self.comp_done = [torch.cuda.Event() for _ in range(self.R)]
        self.d2h_done = [torch.cuda.Event() for _ in range(self.R)]

    def stage_h2d(self, i, host_batches):
        s = i % self.R
        with torch.cuda.stream(self.h2d):
            self.dev_in[s].copy_(host_batches[i], non_blocking=True)
            self.h2d_done[s].record()

    def stage_compute(self, i):
        s = i % self.R
        with torch.cuda.stream(self.comp):
            self.comp.wait_event(self.h2d_done[s])
            y = self.model(self.dev_in[s])
            self.dev_out[s].copy_(y)
            self.comp_done[s].record()

    def stage_d2h(self, i):
        s = i % self.R
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(self.comp_done[s])
            self.host_out[s].copy_(self.dev_out[s], non_blocking=True)
            self.d2h_done[s].record()

    def consume(self, i):
        s = i % self.R
        self.d2h_done[s].synchronize()
        return self.host_out[s].sum(dim=1)  # host reads the pinned slot

    def run(self, host_batches):
        n = len(host_batches)
        results = []
        for t in range(-1, n + 2):
            if 0 <= t - 2 < n:
                results.append(self.consume(t - 2))
            if 0 <= t + 1 < n:
                self.stage_h2d(t + 1, host_batches)
            if 0 <= t < n:
                self.stage_compute(t)
            if 0 <= t - 1 < n:
                self.stage_d2h(t - 1)
        return results


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, D_HID), torch.nn.GELU(),
        torch.nn.Linear(D_HID, D_OUT)).to(DEV).eval()
    g = torch.Generator().manual_seed(1)
    host_batches = [torch.randn(MB, D_IN, generator=g).pin_memory() for _ in range(N_MICRO)]
    pipe = Pipeline(model, NUM_SLOTS)
    torch.cuda.synchronize()  # weights and ring buffers are ready
    with torch.no_grad():
        results = pipe.run(host_batches)
    out = torch.stack(results)
    print(f"{len(results)} micro-batches, checksum {out.abs().sum().item():.3f}")


if __name__ == "__main__":
    main()
