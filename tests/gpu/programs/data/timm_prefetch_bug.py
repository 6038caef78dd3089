# Case timm_prefetch (BUG version)
# Modeled on huggingface/pytorch-image-models timm/data/loader.py `PrefetchLoader`
# (CUDA prefetcher inspired by NVIDIA apex's data_prefetcher). Upstream fix:
# huggingface/pytorch-image-models PR #2784 "Fix #2781, CUDA stream allocation":
# "make the prefetch stream wait on the consumer stream before each batch so storage
# released by the consumer is not overwritten while its queued reads are pending".
# Bug: each batch is allocated on the prefetch stream, consumed on the default stream
# and released by the consumer with no record_stream() and no wait of the prefetch
# stream on the consumer, so the caching allocator hands the block to a later batch
# whose copy/normalize on the prefetch stream can overwrite it while the train step
# that reads it is still queued.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)


def fast_collate(batch):
    """uint8 images stay uint8 on the host; conversion/normalization run on the GPU."""
    tensor = torch.stack([b[0] for b in batch])
    targets = torch.stack([b[1] for b in batch])
    return tensor, targets


class PrefetchLoader:

    def __init__(self, loader, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                 device=torch.device('cuda', 0)):
        self.loader = loader
        self.device = device
        # host-side scaling, blocking H2D copies (as in timm)
        self.mean = torch.tensor([x * 255 for x in mean], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([x * 255 for x in std], device=device).view(1, 3, 1, 1)
        self.stream = torch.cuda.Stream(device=device)  # one stream per loader

    def __iter__(self):
        first = True
        stream = self.stream
        for next_input, next_target in self.loader:

            with torch.cuda.stream(stream):
                next_input = next_input.to(device=self.device, non_blocking=True)
                next_target = next_target.to(device=self.device, non_blocking=True)
                next_input = next_input.float().sub_(self.mean).div_(self.std)

            if not first:
                yield input, target
            else:
                first = False

            torch.cuda.current_stream(self.device).wait_stream(stream)
            input = next_input
            target = next_target

        yield input, target

    def __len__(self):
        return len(self.loader)


class SmallNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean((2, 3)))


def train_one_epoch(model, loader, optimizer):
    model.train()
    total = torch.zeros((), device='cuda')
    for step, (x, y) in enumerate(loader):
        out = model(x)
        loss = F.cross_entropy(out, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.detach()
    return total


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (512, 3, 64, 64), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (512,), generator=g)
    base = DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=False,
                      collate_fn=fast_collate, pin_memory=True, num_workers=0,
                      drop_last=True)
    loader = PrefetchLoader(base)
    model = SmallNet().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(2):
        total = train_one_epoch(model, loader, optimizer)
        print(f'epoch {epoch}: mean loss {total.item() / len(loader):.4f}')
    torch.cuda.synchronize()


if __name__ == '__main__':
    main()
