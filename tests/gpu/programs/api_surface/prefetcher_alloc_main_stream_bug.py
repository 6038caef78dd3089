# Source: NVIDIA/apex examples/imagenet/main_amp.py -- class data_prefetcher (preload/next), copied into many
#   repos (DETR's datasets/data_prefetcher.py, ...).  It documents an alternative to record_stream(): "make sure
#   device inputs are created on the main stream ... self.next_input_gpu = torch.empty_like(self.next_input,
#   device='cuda') ... Need to make sure the memory allocated for next_* is not still in use by the main stream at the
#   time we start copying to next_*: self.stream.wait_stream(torch.cuda.current_stream())".  Here that alternative is
#   used in validate(), with torch.cuda.StreamContext for the side stream and a channels_last copy on the main stream.
# Bug: preload() allocates next_input_gpu on the main (default) stream, then fills and normalizes it on the side
#   stream without the side stream waiting for the main stream.  The caching allocator hands preload a block that the
#   main stream freed a moment ago (an earlier batch's channels_last input / input buffer) while the queued forward of
#   that batch (main stream) has not read it yet; the side stream's H2D copy overwrites it.  alloc-reuse race: the
#   new owner's write on the side stream vs the old tensor's pending read on the main stream.
# Fix: self.stream.wait_stream(torch.cuda.current_stream()) right after the main-stream allocation, before the copy.
import torch
import torch.nn as nn

MODEL_CYCLES = 20_000_000  # the rest of a ResNet forward
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


class data_prefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.mean = torch.tensor(MEAN).cuda().view(1, 3, 1, 1)
        self.std = torch.tensor(STD).cuda().view(1, 3, 1, 1)
        self.preload()

    def preload(self):
        try:
            self.next_input = next(self.loader)
        except StopIteration:
            self.next_input = None
            return
        # device inputs are created on the main stream (alternative to record_stream())
        self.next_input_gpu = torch.empty_like(self.next_input, device="cuda")
        with torch.cuda.StreamContext(self.stream):
            self.next_input_gpu.copy_(self.next_input, non_blocking=True)
            self.next_input = self.next_input_gpu
            self.next_input.sub_(self.mean).div_(self.std)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        input = self.next_input
        self.preload()
        return input


class TinyResNetStem(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        torch.cuda._sleep(MODEL_CYCLES)
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


@torch.no_grad()
def validate(loader, model):
    outputs = []
    prefetcher = data_prefetcher(loader)
    input = prefetcher.next()
    while input is not None:
        input = input.contiguous(memory_format=torch.channels_last)
        outputs.append(model(input))
        input = prefetcher.next()
    return outputs


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = TinyResNetStem().to(device).to(memory_format=torch.channels_last).eval()
    # pinned float batches from a DataLoader(pin_memory=True) with a float collate
    loader = [(torch.rand(32, 3, 96, 96) * 255).pin_memory() for _ in range(10)]

    outputs = validate(loader, model)
    torch.cuda.synchronize(device)

    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    bad = []
    with torch.no_grad():
        for i, (batch, out) in enumerate(zip(loader, outputs)):
            x = batch.to(device).sub_(mean).div_(std)
            ref = model(x.contiguous(memory_format=torch.channels_last))
            if not torch.allclose(out, ref, atol=1e-4, rtol=1e-4):
                bad.append(i)
    print(f"batches with wrong logits: {bad}")
    print(f"match={not bad}")


if __name__ == "__main__":
    main()
