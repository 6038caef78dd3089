# Source: huggingface/diffusers src/diffusers/image_processor.py (VaeImageProcessor.postprocess ->
#   pt_to_numpy: images.cpu().permute(0, 2, 3, 1).float().numpy(), a blocking copy). This program makes the
#   readback asynchronous: uint8 conversion on the GPU, then a non_blocking device->host copy on a copy
#   stream into a reusable pinned output buffer, returned to the caller as a NumPy view. The PyTorch tutorial
#   "A guide on good usage of non_blocking and pin_memory()" (pytorch/tutorials PR #2983 / #3261) and
#   pytorch/pytorch issue #86264 describe the rule: a GPU->CPU non_blocking copy must be synchronized before
#   the host reads the destination.
#
# A generator yields one batch of images at a time; the consumer (host) reads the pixels with NumPy.
#   postproc_pinned_readback_bug.py:   the NumPy view is handed out right after the copy is enqueued.
#   postproc_pinned_readback_fixed.py: copy_done.synchronize() before handing out the view.
# Lifetime of the GPU uint8 tensor is handled correctly in both (record_stream on the copy stream).
import numpy as np
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms spin on the copy stream (queued behind earlier transfers)
DEVICE = torch.device("cuda:0")
BATCH = 2
LAT_CH = 4
LAT_HW = 32
HW = 256
N_BATCHES = 3


class TinyVAEDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(LAT_CH, 3 * 64, kernel_size=3, padding=1)
        self.shuffle = nn.PixelShuffle(8)

    def forward(self, latents):
        return torch.tanh(self.shuffle(self.conv(latents)))  # (B, 3, 256, 256) in [-1, 1]


def to_uint8_nhwc(images):
    images = (images / 2 + 0.5).clamp(0, 1)
    return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class AsyncImageReadback:
    def __init__(self):
        self.copy_stream = torch.cuda.Stream()
        self.pinned = torch.empty((BATCH, HW, HW, 3), dtype=torch.uint8, pin_memory=True)
        self.copy_done = torch.cuda.Event()

    def postprocess(self, images):
        pixels = to_uint8_nhwc(images)  # default stream
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            self.pinned.copy_(pixels, non_blocking=True)
            self.copy_done.record()
        pixels.record_stream(self.copy_stream)  # freed on return while the copy stream may still read it
        # the device->host copy must be complete before the host reads the pinned buffer
        self.copy_done.synchronize()
        return self.pinned.numpy()  # zero-copy view of the pinned buffer


def iter_images(vae, latent_batches, readback):
    for latents in latent_batches:
        images = vae(latents)
        yield readback.postprocess(images)


def main():
    torch.manual_seed(0)
    vae = TinyVAEDecoder().to(DEVICE)
    latent_batches = [torch.randn(BATCH, LAT_CH, LAT_HW, LAT_HW, device=DEVICE) for _ in range(N_BATCHES)]

    with torch.no_grad():
        reference = 0
        for latents in latent_batches:
            reference += int(to_uint8_nhwc(vae(latents)).cpu().numpy().astype(np.int64).sum())

        readback = AsyncImageReadback()
        torch.cuda.synchronize()
        checksum = 0
        for arr in iter_images(vae, latent_batches, readback):
            checksum += int(arr.astype(np.int64).sum())  # host reads the pixels (PIL/encoder would here)

    torch.cuda.synchronize()
    match = checksum == reference
    print(f"checksum={checksum} reference={reference} match={match}")


if __name__ == "__main__":
    main()
