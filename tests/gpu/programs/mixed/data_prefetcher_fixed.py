# Source: NVIDIA/apex examples/imagenet/main_amp.py, class data_prefetcher (preload()/next()); the same
#         side-stream H2D prefetch + record_stream pattern is in torchrec TrainPipelineSparseDist._wait_for_batch.
# Bug: preload() copies the next pinned batch to the GPU on the prefetcher's side stream, so the device
#      tensors are allocated from the side stream's pool. next() makes the default stream wait for the side
#      stream but never calls input.record_stream(torch.cuda.current_stream()). When the training loop
#      rebinds `input`, the block goes straight back to the side stream's pool and a later preload() (two
#      batches on) allocates it and overwrites it with a new batch while the default stream's train step
#      has not read the old batch yet (side stream never waits for the default stream).
# Fix: next() calls input.record_stream(torch.cuda.current_stream()) (as apex does), so the allocator defers
#      reuse of the block until the default stream's work enqueued before the free has completed.
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

SLEEP_CYCLES = 30_000_000  # ~15 ms: stands in for a heavy forward/backward on the default stream


class data_prefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.mean = torch.tensor([0.485 * 255, 0.456 * 255, 0.406 * 255]).cuda().view(1, 3, 1, 1)
        self.std = torch.tensor([0.229 * 255, 0.224 * 255, 0.225 * 255]).cuda().view(1, 3, 1, 1)
        self.preload()

    def preload(self):
        try:
            (self.next_input,) = next(self.loader)
        except StopIteration:
            self.next_input = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_input = self.next_input.float()
            self.next_input = self.next_input.sub_(self.mean).div_(self.std)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        input = self.next_input
        if input is not None:
            input.record_stream(torch.cuda.current_stream())
        self.preload()
        return input


class TinyEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16 * 32 * 32, 10)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def main():
    torch.manual_seed(0)
    n_batches, bs = 12, 96
    images = torch.randint(0, 256, (n_batches * bs, 3, 32, 32), dtype=torch.uint8)
    loader = DataLoader(TensorDataset(images), batch_size=bs, shuffle=False, pin_memory=True)

    model = TinyEncoder().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()

    seen = []  # per-sample checksums of what the training step actually consumed
    prefetcher = data_prefetcher(loader)
    input = prefetcher.next()
    i = 0
    while input is not None:
        torch.cuda._sleep(SLEEP_CYCLES)  # default stream lags behind the prefetch stream
        seen.append(input.sum(dim=(1, 2, 3)))
        loss = model(input).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        i += 1
        input = prefetcher.next()
    torch.cuda.synchronize()

    # Reference: normalise every batch on the CPU, no streams involved.
    mean = torch.tensor([0.485 * 255, 0.456 * 255, 0.406 * 255]).view(1, 3, 1, 1)
    std = torch.tensor([0.229 * 255, 0.224 * 255, 0.225 * 255]).view(1, 3, 1, 1)
    ref = [((b.float() - mean) / std).sum(dim=(1, 2, 3)) for b in images.split(bs)]
    got = [s.cpu() for s in seen]
    match = len(got) == len(ref) and all(torch.allclose(g, r, rtol=1e-4, atol=1e-2) for g, r in zip(got, ref))
    print(f"steps={i} match={match}")


if __name__ == "__main__":
    main()
