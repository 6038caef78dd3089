# Case ffcv_slots (BUG version)
# Modeled on libffcv/ffcv ffcv/loader/epoch_iterator.py (EpochIterator: memory banks
# with batches_ahead + 2 slots, one CUDA stream per slot, ToDevice / ToTorchImage /
# flip / NormalizeImage written into the slot's bank, `current_stream().wait_stream(
# slot_stream)` in __next__) and libffcv/ffcv#198 "[Bug] Synchronization issue on GPU"
# (two models got different inputs unless torch.cuda.synchronize() was called).
# Re-created single-threaded (the real iterator runs the pipeline in a Thread).
# Bug: a slot's stream overwrites the slot's GPU buffers for batch b+3 without waiting
# for the default-stream train step that is still reading batch b from them.
import collections

import torch
import torch.nn as nn
import torch.nn.functional as F


class Loader:
    def __init__(self, n=640, batch_size=64, res=64, batches_ahead=1, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, res, res, 3), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.batch_size, self.res, self.batches_ahead = batch_size, res, batches_ahead
        # host-side constants, blocking H2D copies
        self.mean = torch.tensor([123.675, 116.28, 103.53], device='cuda').view(1, 3, 1, 1)
        self.std = torch.tensor([58.395, 57.12, 57.375], device='cuda').view(1, 3, 1, 1)
        self.flip_gen = torch.Generator(device='cuda').manual_seed(seed)

    def batch_indices(self):
        n = len(self.labels) // self.batch_size * self.batch_size
        return [range(i, i + self.batch_size) for i in range(0, n, self.batch_size)]

    def decode(self, ixes):
        # stands in for the compiled CPU decode stage; its output is page-locked
        return (self.images[ixes.start:ixes.stop].pin_memory(),
                self.labels[ixes.start:ixes.stop].pin_memory())

    def __iter__(self):
        return EpochIterator(self)


class EpochIterator:
    def __init__(self, loader):
        self.loader = loader
        self.slots = loader.batches_ahead + 2
        self.cuda_streams = [torch.cuda.Stream() for _ in range(self.slots)]
        b, r = loader.batch_size, loader.res
        # memory banks, allocated once per epoch (Pipeline.allocate_memory)
        self.bank_raw = torch.empty((self.slots, b, r, r, 3), dtype=torch.uint8, device='cuda')
        self.bank_img = torch.empty((self.slots, b, 3, r, r), dtype=torch.float32, device='cuda')
        self.bank_lbl = torch.empty((self.slots, b), dtype=torch.int64, device='cuda')
        self.iter_ixes = iter(loader.batch_indices())
        self.output_queue = collections.deque()
        self.current_batch_slot = 0
        for _ in range(loader.batches_ahead):
            self.produce()

    def run_pipeline(self, ixes, slot):
        imgs, lbls = self.loader.decode(ixes)
        with torch.cuda.stream(self.cuda_streams[slot]):
            raw = self.bank_raw[slot]
            raw.copy_(imgs, non_blocking=True)                       # ToDevice
            self.bank_lbl[slot].copy_(lbls, non_blocking=True)
            x = raw.permute(0, 3, 1, 2).float()                      # ToTorchImage
            flip = torch.rand(x.shape[0], device='cuda', generator=self.loader.flip_gen) < 0.5
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)    # RandomHorizontalFlip
            torch.sub(x, self.loader.mean, out=self.bank_img[slot]).div_(self.loader.std)

    def produce(self):
        ixes = next(self.iter_ixes, None)
        if ixes is None:
            return
        slot = self.current_batch_slot
        self.current_batch_slot = (slot + 1) % self.slots
        self.run_pipeline(ixes, slot)
        self.output_queue.append(slot)

    def __next__(self):
        self.produce()  # keep `batches_ahead` batches in flight
        if not self.output_queue:
            raise StopIteration
        slot = self.output_queue.popleft()
        torch.cuda.current_stream().wait_stream(self.cuda_streams[slot])  # copy done
        return self.bank_img[slot], self.bank_lbl[slot]

    def __iter__(self):
        return self


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


def main():
    torch.manual_seed(0)
    loader = Loader()
    model = Net().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    for epoch in range(2):
        it = iter(loader)
        total, n = torch.zeros((), device='cuda'), 0
        for x, y in it:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            n += 1
        torch.cuda.synchronize()  # epoch end; the banks are released after this
        print(f'epoch {epoch}: {n} batches, mean loss {total.item() / n:.4f}')


if __name__ == '__main__':
    main()
