"""pinned_staging (fixed version).

Source: NVIDIA/apex examples/imagenet/main_amp.py `data_prefetcher` (side-stream H2D copy with
non_blocking=True, consumer waits on the stream and calls record_stream), here with one
persistent pinned staging buffer to avoid a pin_memory() per batch.  The host refills the
staging buffer for batch i+1 while the non_blocking H2D copy of batch i may still be reading it
-- the same hazard as 1bit-MONSTER/1bit-MONSTER#2436 (pinned staging buffer refilled while its
DMA is in flight).

Fix: pin a fresh buffer per batch and drop it right after enqueueing the copy.  Freeing pinned
memory while a non_blocking copy still reads it is safe here: copy_kernel_cuda calls
CachingHostAllocator_recordEvent(ptr, ctx, stream) for the pinned side of every non_blocking
copy, and the host allocator does not hand the block out again before that event completes.
"""
import torch

DEV = torch.device("cuda", 0)
BATCHES, SHAPE = 8, (64, 3, 64, 64)


def cpu_loader(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(SHAPE, generator=g)            # pageable CPU batch


class CUDAPrefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream(DEV)
        self.preload()

    def preload(self):
        try:
            cpu_batch = next(self.loader)
        except StopIteration:
            self.next_input = None
            return
        staging = cpu_batch.pin_memory()                        # FIX: fresh pinned block
        with torch.cuda.stream(self.stream):
            x = staging.to(DEV, non_blocking=True)              # async H2D reads it
            self.next_input = x.sub_(0.5).div_(0.25)
        # `staging` is freed on return while the copy may still run (host allocator event)

    def next(self):
        torch.cuda.current_stream(DEV).wait_stream(self.stream)
        x = self.next_input
        if x is not None:
            x.record_stream(torch.cuda.current_stream(DEV))     # allocated on self.stream
        self.preload()
        return x


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(3 * 64 * 64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    target = torch.randint(0, 10, (SHAPE[0],), device=DEV)
    total = torch.zeros((), device=DEV)
    prefetcher = CUDAPrefetcher(cpu_loader(BATCHES))
    x = prefetcher.next()
    while x is not None:
        loss = torch.nn.functional.cross_entropy(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.detach()
        x = prefetcher.next()
    torch.cuda.synchronize()
    print("mean loss", round(total.item() / BATCHES, 4))


if __name__ == "__main__":
    main()
