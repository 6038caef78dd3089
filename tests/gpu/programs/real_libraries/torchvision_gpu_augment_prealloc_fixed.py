# Source: torchvision torchvision/transforms/v2 (ToDtype, Resize, Normalize run as tensor kernels on CUDA
#   batches, e.g. frames from torchvision.io.decode_jpeg(device="cuda")) and torchvision.models.resnet18; the
#   pattern of a user-side "augment the next batch on a side stream" pipeline, with the output buffer
#   preallocated in channels_last outside the stream context (the CUDA semantics note in the PyTorch docs:
#   a tensor allocated on one stream and used on another needs the using stream to wait for the allocating one).
# Bug: submit() allocates the output buffer with torch.empty on the default stream, then fills it on the
#   augmentation stream without making that stream wait for the default stream. The caching allocator gives
#   the new buffer the block of batch i-1, freed by the host a moment earlier while model(batch i-1) is still
#   queued on the busy default stream; the augmentation stream writes batch i+1 into that block before the
#   default stream has read it (a reused block written by a stream that is not ordered after the old
#   tensor's last use).
# Fix: self.stream.wait_stream(torch.cuda.current_stream()) right after the allocation, so the augmentation
#   stream only writes the new buffer once all earlier work on the allocating stream is done.
# This file: FIXED version.
import torch
import torchvision
from torchvision.transforms import v2

DEVICE = torch.device("cuda", 0)
BATCH, RAW, RES, N_BATCHES = 32, 160, 112, 8
SLEEP_CYCLES = 40_000_000  # ~20 ms: the training/inference step is the bottleneck


class GpuAugmentPipeline:
    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)
        self.transforms = v2.Compose([
            v2.ToDtype(torch.float32, scale=True),
            v2.Resize((RES, RES), antialias=True),
            v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ])

    def submit(self, frames):
        """Preprocess a uint8 NCHW batch that already lives on the GPU; returns (tensor, ready_event)."""
        out = torch.empty((frames.shape[0], 3, RES, RES), device=frames.device,
                          memory_format=torch.channels_last)
        self.stream.wait_stream(torch.cuda.current_stream())  # FIX: the block may still be in use on this stream
        with torch.cuda.stream(self.stream):
            out.copy_(self.transforms(frames))
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return out, ready


def main():
    torch.manual_seed(0)
    # A cache of decoded clips, resident on the GPU (decoded once, before the loop).
    frames = [(torch.randint(0, 200, (BATCH, 1, 1, 1)) + torch.randint(0, 56, (BATCH, 3, RAW, RAW)))
              .to(torch.uint8).to(DEVICE) for _ in range(N_BATCHES)]
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    model = model.to(DEVICE, memory_format=torch.channels_last).eval()
    pipeline = GpuAugmentPipeline(DEVICE)
    torch.cuda.synchronize()

    logits = []
    with torch.no_grad():
        pending = pipeline.submit(frames[0])
        for i in range(N_BATCHES):
            x, ready = pending
            torch.cuda.current_stream().wait_event(ready)
            if i + 1 < N_BATCHES:
                pending = pipeline.submit(frames[i + 1])  # overlap: preprocess i+1 while the model runs on i
            torch.cuda._sleep(SLEEP_CYCLES)
            logits.append(model(x))
    torch.cuda.synchronize()

    # Reference: preprocess and run each batch on the default stream only.
    ok, worst = len(logits) == N_BATCHES, 0.0
    with torch.no_grad():
        for i in range(N_BATCHES):
            ref_x = pipeline.transforms(frames[i]).contiguous(memory_format=torch.channels_last)
            ref = model(ref_x)
            worst = max(worst, (ref - logits[i]).abs().max().item())
            ok = ok and torch.allclose(ref, logits[i], rtol=1e-3, atol=1e-4)
    print(f"batches={len(logits)} max_abs_diff={worst:.3e}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
