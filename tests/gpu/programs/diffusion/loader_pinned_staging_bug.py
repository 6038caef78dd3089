# Source: NVIDIA apex examples/imagenet/main_amp.py data_prefetcher (side-stream H2D + normalization, the
#   consumer does current_stream().wait_stream(...) and input.record_stream(current_stream())), combined with
#   the pinned-staging reuse hazard described in pytorch/tutorials intermediate_source/pinmem_nonblock.py
#   (PR #3261: "mutating the original copy after calling the host-to-device transfer may corrupt the data
#   received on GPU") and vllm-project/vllm PR #32799 (reused pinned CPU buffers race with the previous
#   step's async copy).
#
# A loader thread prepares img2img / VAE-encode inputs: it writes each decoded uint8 image into ONE reusable
# pinned staging buffer, copies it to the GPU with non_blocking=True on its own stream and runs torchvision-
# style transforms (to float, resize, normalize) there, then hands (tensor, event) to the main thread.
#   loader_pinned_staging_bug.py:   the thread refills the staging buffer while the previous H2D copy that
#                                   reads it may still be queued on the loader stream.
#   loader_pinned_staging_fixed.py: the thread polls copy_done.query() before refilling the buffer.
import queue
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms spin on the loader stream (it is behind with earlier transforms)
DEVICE = torch.device("cuda:0")
N_IMAGES = 6
SRC_HW = 256
OUT_HW = 128


class GpuTransformLoader:
    def __init__(self, decoded_images, mean, std):
        self.decoded_images = decoded_images  # CPU uint8 HWC tensors ("decoded JPEGs")
        self.mean = mean
        self.std = std
        self.stream = torch.cuda.Stream()
        self.staging = torch.empty((SRC_HW, SRC_HW, 3), dtype=torch.uint8, pin_memory=True)
        self.copy_done = torch.cuda.Event()
        self.queue = queue.Queue(maxsize=2)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._worker, daemon=True)

    def _transform(self, x):
        x = x.permute(2, 0, 1).unsqueeze(0).float().div_(255)
        x = F.interpolate(x, size=(OUT_HW, OUT_HW), mode="bilinear", align_corners=False)
        return (x - self.mean) / self.std

    def _worker(self):
        for img in self.decoded_images:
            if self.stop_event.is_set():
                break
            self.staging.copy_(img)  # host writes the pinned staging buffer
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(SLEEP_CYCLES)
                x = self.staging.to(DEVICE, non_blocking=True)
                self.copy_done.record()
                x = self._transform(x)
                ready = torch.cuda.Event()
                ready.record()
            self.queue.put((x, ready))
        self.queue.put(None)

    def __iter__(self):
        self.thread.start()
        while True:
            item = self.queue.get()
            if item is None:
                break
            x, ready = item
            torch.cuda.current_stream().wait_event(ready)
            x.record_stream(torch.cuda.current_stream())
            yield x
        self.thread.join()


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    decoded = [torch.randint(0, 256, (SRC_HW, SRC_HW, 3), dtype=torch.uint8, generator=g) for _ in range(N_IMAGES)]
    mean = torch.tensor([0.5, 0.5, 0.5], device=DEVICE).view(1, 3, 1, 1)
    std = torch.tensor([0.5, 0.5, 0.5], device=DEVICE).view(1, 3, 1, 1)
    vae_encoder = nn.Conv2d(3, 8, kernel_size=8, stride=8).to(DEVICE)

    with torch.no_grad():
        loader = GpuTransformLoader(decoded, mean, std)
        ref = torch.cat([vae_encoder(loader._transform(img.to(DEVICE))) for img in decoded])
        torch.cuda.synchronize()

        latents = [vae_encoder(x) for x in loader]
        out = torch.cat(latents)

    torch.cuda.synchronize()
    checksum = out.double().sum().item()
    reference = ref.double().sum().item()
    match = torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
