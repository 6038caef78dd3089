"""Training loop with an asynchronous metrics-logger thread: every step the
trainer copies a small stats vector (loss, grad norm, accuracy) into a pinned
slot with a non_blocking D2H copy, records a per-slot event and hands the slot
to a logger thread through queue.Queue; the logger formats it with .tolist()
and returns the slot through a semaphore.  The trainer never syncs the host.

Modeled on: sgl-project/sglang PR #16493 (non_blocking GPU->CPU copy read
without a synchronization), pytorch/pytorch issue #86264 (to("cpu",
non_blocking=True) "works weird" when read before syncing) and the
pytorch/tutorials pinmem_nonblock guide.  Self-contained re-creation.

FIXED: the logger calls copied[slot].synchronize() BEFORE reading the slot,
so the .tolist() read of the pinned slot is ordered after the D2H copy.
"""
import queue
import threading

import torch
import torch.nn.functional as F

DEV = torch.device("cuda:0")
STEPS = 12
N_SLOTS = 4
BATCH, FEAT, CLASSES = 256, 512, 10


class MetricsLogger(threading.Thread):
    def __init__(self):
        super().__init__(name="metrics-logger", daemon=True)
        self.slots = torch.zeros(N_SLOTS, 3, pin_memory=True)
        self.copied = [torch.cuda.Event() for _ in range(N_SLOTS)]
        self.free = threading.Semaphore(N_SLOTS)
        self.q = queue.Queue()
        self.lines = []

    def publish(self, step, stats):
        """Trainer side: async D2H of `stats` into a free pinned slot."""
        if not self.free.acquire(timeout=60):
            raise RuntimeError("logger stalled")
        slot = step % N_SLOTS
        self.slots[slot].copy_(stats, non_blocking=True)
        self.copied[slot].record()
        self.q.put((step, slot))

    def run(self):
        while (item := self.q.get(timeout=60)) is not None:
            step, slot = item
            self.copied[slot].synchronize()
            loss, gnorm, acc = self.slots[slot].tolist()
            self.lines.append(f"step {step:3d} loss {loss:.4f} |g| {gnorm:.3f} acc {acc:.3f}")
            self.free.release()


def main():
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(STEPS, BATCH, FEAT, generator=g).to(DEV)
    ys = torch.randint(0, CLASSES, (STEPS, BATCH), generator=g).to(DEV)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEAT, 256), torch.nn.ReLU(), torch.nn.Linear(256, CLASSES)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logger = MetricsLogger()
    torch.cuda.synchronize()  # data and weights ready
    logger.start()

    for step in range(STEPS):
        logits = model(xs[step])
        loss = F.cross_entropy(logits, ys[step])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc = (logits.argmax(1) == ys[step]).float().mean()
        stats = torch.stack([loss.detach(), gnorm, acc])
        logger.publish(step, stats)

    torch.cuda.synchronize()
    logger.q.put(None)
    logger.join()
    print("\n".join(logger.lines[-3:]))


if __name__ == "__main__":
    main()
