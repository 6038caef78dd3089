# Source: timm (huggingface/pytorch-image-models) timm/data/loader.py, class PrefetchLoader.__iter__ with
#   fast_collate: the next batch is copied and normalized under `with torch.cuda.stream(stream)`, the consumer
#   runs torch.cuda.current_stream().wait_stream(stream), but the batch is never record_stream()'d on the
#   consumer stream. NVIDIA apex's data_prefetcher (which timm credits) calls input.record_stream(); this user
#   copy of the timm prefetcher, like timm's own, does not.
# Bug: every normalized batch is allocated on the prefetch side stream and read by the model on the default
#   stream. When the loop rebinds `images`, batch k is freed and the caching allocator hands its block straight
#   back to the side stream, which is ordered after nothing on the default stream: the float conversion
#   of a later batch (k+3) is written into batch k's block while model(batch k) is still queued behind the busy
#   default stream (missing record_stream; the default stream's read of batch k has no edge to the side
#   stream's later write).
# Fix: next_input.record_stream(torch.cuda.current_stream()) once the consumer stream has waited for the
#   prefetch stream, so the allocator keeps the block until the default stream's work on it has finished.
# This file: BUG version.
import numpy as np
import torch
import torch.utils.data

import timm
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.data.loader import fast_collate

SLEEP_CYCLES = 40_000_000  # ~20 ms of GPU time per step: a busy default stream
BATCH, RES, N_BATCHES = 32, 64, 8


class InMemoryImages(torch.utils.data.Dataset):
    """Decoded uint8 CHW images kept in RAM (what fast_collate expects), random but distinct per image."""

    def __init__(self, n, res, seed=0):
        rng = np.random.default_rng(seed)
        level = rng.integers(0, 200, size=(n, 1, 1, 1))
        noise = rng.integers(0, 56, size=(n, 3, res, res))
        self.images = (level + noise).astype(np.uint8)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], 0  # unlabeled: feature extraction only


class CudaPrefetcher:
    """The project's copy of timm's PrefetchLoader, trimmed to images (targets stay on the host)."""

    def __init__(self, loader, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, device=torch.device("cuda")):
        self.loader = loader
        self.device = device
        self.mean = torch.tensor([x * 255 for x in mean], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([x * 255 for x in std], device=device).view(1, 3, 1, 1)

    def __iter__(self):
        stream = torch.cuda.Stream(device=self.device)
        first = True
        for next_input, _ in self.loader:
            with torch.cuda.stream(stream):
                next_input = next_input.to(device=self.device, non_blocking=True)
                next_input = next_input.float().sub_(self.mean).div_(self.std)
            if not first:
                yield input
            else:
                first = False
            torch.cuda.current_stream(self.device).wait_stream(stream)
            input = next_input
        yield input

    def __len__(self):
        return len(self.loader)


def main():
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    dataset = InMemoryImages(BATCH * N_BATCHES, RES)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False, num_workers=0,
                                         collate_fn=fast_collate, pin_memory=True)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).to(device).eval()
    torch.cuda.synchronize()

    logits = []
    with torch.no_grad():
        for images in CudaPrefetcher(loader, device=device):
            torch.cuda._sleep(SLEEP_CYCLES)  # stand-in for a large backbone: the GPU lags behind the host
            logits.append(model(images))
    torch.cuda.synchronize()

    # Reference: the same batches, copied and normalized synchronously on the default stream.
    mean = torch.tensor([x * 255 for x in IMAGENET_DEFAULT_MEAN], device=device).view(1, 3, 1, 1)
    std = torch.tensor([x * 255 for x in IMAGENET_DEFAULT_STD], device=device).view(1, 3, 1, 1)
    ref_loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False, collate_fn=fast_collate)
    ok, worst = len(logits) == N_BATCHES, 0.0
    with torch.no_grad():
        for k, (cpu_images, _) in enumerate(ref_loader):
            ref = model(cpu_images.to(device).float().sub_(mean).div_(std))
            worst = max(worst, (ref - logits[k]).abs().max().item())
            ok = ok and torch.allclose(ref, logits[k], rtol=1e-3, atol=1e-4)
    print(f"batches={len(logits)} max_abs_diff={worst:.3e}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
