# prefetch_slot_event (BUG version)
# Source: modeled on the side-stream batch prefetcher of NVIDIA/apex
# examples/imagenet/main_amp.py (`data_prefetcher`: H2D copy + normalize on a side
# stream, consumer waits on the main stream), extended to two device slots with
# per-slot "ready"/"free" events that are re-recorded on every refill. The slot
# index mix-up itself is a plausible pattern, not a specific reported issue.
# Semantics: Stream.wait_event() uses the LATEST record of the event at the time
# of the call (a later re-record does not matter); waiting on an event that was
# never recorded is a no-op (c10/cuda/CUDAEvent.h: block() does nothing when
# !is_created_).
import torch

torch.manual_seed(0)
DEV = torch.device("cuda:0")
BATCH, FEAT, STEPS = 64, 1024, 8


class SlotPrefetcher:
    """Fills two device slots on a side stream while the main stream trains."""

    def __init__(self, host_batches):
        self.host = host_batches                      # pinned CPU tensors
        self.stream = torch.cuda.Stream()
        self.bufs = [torch.empty(BATCH, FEAT, device=DEV) for _ in range(2)]
        self.ready = [torch.cuda.Event() for _ in range(2)]   # side -> main
        self.free = [torch.cuda.Event() for _ in range(2)]    # main -> side
        self.next_idx = 0
        self._preload()

    def _preload(self):
        if self.next_idx >= len(self.host):
            return
        slot = self.next_idx % 2
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.free[slot])   # main released this slot
            self.bufs[slot].copy_(self.host[self.next_idx], non_blocking=True)
            self.bufs[slot].sub_(0.5).mul_(2.0)       # normalize on the side stream
            self.ready[slot].record(self.stream)      # re-recorded on every refill
        self.next_idx += 1

    def next(self):
        slot = (self.next_idx - 1) % 2                # slot of the batch preloaded before
        # BUG: indexes with next_idx instead of slot -> waits on the OTHER slot's
        # event: never recorded at step 0 (no-op), a stale record (batch-1) later.
        torch.cuda.current_stream().wait_event(self.ready[self.next_idx % 2])
        self._preload()                               # start refilling the other slot
        return self.bufs[slot], slot

    def release(self, slot):
        self.free[slot].record(torch.cuda.current_stream())


def main():
    host = [torch.rand(BATCH, FEAT).pin_memory() for _ in range(STEPS)]
    model = torch.nn.Linear(FEAT, 256).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total = torch.zeros((), device=DEV)
    pf = SlotPrefetcher(host)
    for step in range(STEPS):
        x, slot = pf.next()
        loss = model(x).square().mean()               # main stream reads bufs[slot]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        pf.release(slot)
        total += loss.detach()
    torch.cuda.synchronize()
    print("mean loss", total.item() / STEPS)


if __name__ == "__main__":
    main()
