# Case: video-frame classification loop that stages every decoded frame in ONE pinned host buffer
# (allocated once with .pin_memory() and reused every iteration) and uploads it with a
# non_blocking host-to-device copy.
# Source: plausible pattern; the hazard is the one described by pytorch/pytorch #126946 ("memory
#   ordering issue for async H2D with pin memory": ezyang - the source must stay unmodified while
#   the transfer is in progress) and #127612 (albanD's `b.copy_(a, non_blocking=True); a.fill_(-1)`
#   example), and in the pytorch tutorial "A guide on good usage of non_blocking and pin_memory()".
# BUG: FrameUploader.upload() overwrites the pinned staging buffer on the host for frame i+1 while
#   the non_blocking H2D copy of frame i, queued on the default stream, may still be reading it.
import torch
import torch.nn as nn
import torch.nn.functional as F


class FakeVideoDecoder:
    """Stands in for a CPU video decoder (PyAV / cv2) that returns HWC uint8 frames."""

    def __init__(self, n_frames, h=360, w=640, seed=0):
        self.n, self.h, self.w = n_frames, h, w
        self.g = torch.Generator().manual_seed(seed)

    def __iter__(self):
        for _ in range(self.n):
            yield torch.randint(0, 256, (self.h, self.w, 3), dtype=torch.uint8, generator=self.g)


class FrameUploader:
    def __init__(self, h, w, device="cuda"):
        self.staging = torch.empty(h, w, 3, dtype=torch.uint8).pin_memory()
        self.gpu_frame = torch.empty(h, w, 3, dtype=torch.uint8, device=device)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)

    def upload(self, frame):
        self.staging.copy_(frame)  # host write into the pinned buffer
        self.gpu_frame.copy_(self.staging, non_blocking=True)  # async H2D on the current stream
        x = self.gpu_frame.permute(2, 0, 1).unsqueeze(0).float().div_(255)
        x = F.interpolate(x, size=(224, 224), mode="bilinear", align_corners=False)
        return (x - self.mean) / self.std


class TinyResNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 7, 2, 3), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.layers = nn.ModuleList()
        ch = 32
        for out in (64, 128, 256):
            self.layers.append(nn.Sequential(nn.Conv2d(ch, out, 3, 2, 1), nn.BatchNorm2d(out), nn.ReLU(),
                                             nn.Conv2d(out, out, 3, 1, 1), nn.BatchNorm2d(out), nn.ReLU()))
            ch = out
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.fc(x.mean((2, 3)))


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = TinyResNet().cuda().eval()
    decoder = FakeVideoDecoder(n_frames=12)
    uploader = FrameUploader(decoder.h, decoder.w)
    preds = []
    for frame in decoder:
        x = uploader.upload(frame)
        logits = model(x)
        preds.append(logits.argmax(-1))  # stays on the GPU: no host sync inside the loop
    labels = torch.cat(preds).tolist()
    print("top-1 per frame", labels)


if __name__ == "__main__":
    main()
