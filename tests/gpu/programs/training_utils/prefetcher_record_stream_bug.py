# Case: prefetcher_record_stream (BUG version)
# Source: the apex ImageNet data_prefetcher (NVIDIA/apex examples/imagenet/main_amp.py),
# which calls input.record_stream(torch.cuda.current_stream()) in next(); many copies
# drop that call, e.g. pprp/PyTorch-CIFAR-Model-Hub lib/utils/data_prefetch.py
# ("Ref: .../apex/.../examples/imagenet/main_amp.py"), which has the wait_stream but no
# record_stream.
# Bug: the batch tensors are allocated on the prefetch stream (H2D copy + float/normalize),
# consumed on the default stream, and freed without record_stream(default). The caching
# allocator hands their blocks back to the prefetch stream, whose next preload() writes
# into them while the default stream may still be reading the old batch; the prefetch
# stream never waits for the default stream.
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")


class DataPrefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream(device=DEV)
        with torch.cuda.stream(self.stream):
            self.mean = torch.tensor([0.485 * 255, 0.456 * 255, 0.406 * 255], device=DEV).view(1, 3, 1, 1)
            self.std = torch.tensor([0.229 * 255, 0.224 * 255, 0.225 * 255], device=DEV).view(1, 3, 1, 1)
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = None
            self.next_target = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_target = self.next_target.cuda(non_blocking=True)
            self.next_input = self.next_input.float()
            self.next_input = self.next_input.sub_(self.mean).div_(self.std)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        input = self.next_input
        target = self.next_target
        # (missing: input.record_stream(torch.cuda.current_stream()) and the same for target)
        self.preload()
        return input, target


class SmallResNet(nn.Module):
    def __init__(self, n_cls=10):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1))
        self.fc = nn.Linear(32, n_cls)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = F.relu(h + self.block(h))
        return self.fc(h.mean(dim=(2, 3)))


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(8)
    # uint8 images in pinned memory, as produced by DataLoader(pin_memory=True) + fast_collate
    loader = [(torch.randint(0, 256, (256, 3, 32, 32), dtype=torch.uint8, generator=g).pin_memory(),
               torch.randint(0, 10, (256,), generator=g).pin_memory()) for _ in range(10)]
    model = SmallResNet().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    prefetcher = DataPrefetcher(loader)
    input, target = prefetcher.next()
    losses = []
    while input is not None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(input), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        input, target = prefetcher.next()  # drops the last reference to the old batch
    torch.cuda.synchronize()
    print("%d steps, last loss %.4f" % (len(losses), losses[-1].item()))


if __name__ == "__main__":
    main()
