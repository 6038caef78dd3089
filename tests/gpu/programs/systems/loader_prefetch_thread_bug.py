"""DataLoader(num_workers=0, pin_memory=True) feeding a background CUDA
prefetcher thread: the thread copies each pinned batch to the GPU and
normalizes it on its own stream, then hands (x, y, event) to the training loop
through a bounded queue.Queue.

Modeled on: NVIDIA/apex examples/imagenet/main_amp.py `data_prefetcher`
(input.record_stream(torch.cuda.current_stream()) after wait_stream) and the
many copies of it that drop the record_stream call (e.g. putshua/
SNN_conversion_QCFS Preprocess/prefetcher.py); meta-pytorch/torchrec PR #4191
(record_stream missing for one consuming stream -> allocator recycles blocks).

BUG: the consumer orders the main stream after the copy (wait_event) but never
calls record_stream(main) on x / y.  They were allocated on the prefetch
stream, so when the loop drops them the caching allocator returns their blocks
to the prefetch stream's pool at once, and the prefetch thread's next
allocations are not ordered after the main stream's forward/backward on them.
"""
import queue
import threading

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

DEV = torch.device("cuda:0")
N_SAMPLES = 512
BATCH = 32
FEAT = 1024
CLASSES = 10
DEPTH = 2


class CudaPrefetcher:
    def __init__(self, loader, depth=DEPTH):
        self.loader = loader
        self.q = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._worker, name="cuda-prefetch", daemon=True)
        self.thread.start()

    def _worker(self):
        torch.cuda.set_device(DEV)
        stream = torch.cuda.Stream(device=DEV)
        with torch.cuda.stream(stream):
            for x, y in self.loader:  # pinned CPU tensors
                x = x.to(DEV, non_blocking=True)
                y = y.to(DEV, non_blocking=True)
                x = (x - x.mean(dim=1, keepdim=True)) * torch.rsqrt(x.var(dim=1, keepdim=True) + 1e-5)
                ready = torch.cuda.Event()
                ready.record(stream)
                self.q.put((x, y, ready))
        self.q.put(None)

    def __iter__(self):
        main = torch.cuda.current_stream()
        while (item := self.q.get(timeout=60)) is not None:
            x, y, ready = item
            main.wait_event(ready)
            yield x, y
        self.thread.join()


def main():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(N_SAMPLES, FEAT, generator=g)
    labels = torch.randint(0, CLASSES, (N_SAMPLES,), generator=g)
    loader = DataLoader(TensorDataset(feats, labels), batch_size=BATCH,
                        shuffle=False, num_workers=0, pin_memory=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEAT, 512), torch.nn.ReLU(), torch.nn.Linear(512, CLASSES)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.cuda.synchronize()  # weights ready before the prefetcher starts

    loss_sum = torch.zeros((), device=DEV)
    steps = 0
    for x, y in CudaPrefetcher(loader):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.detach()
        steps += 1
    torch.cuda.synchronize()
    print(f"{steps} steps, mean loss {loss_sum.item() / steps:.4f}")


if __name__ == "__main__":
    main()
