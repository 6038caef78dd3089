# Source: NVIDIA/apex examples/imagenet/main_amp.py, class data_prefetcher (preload()/next()) and fast_collate()
#   (PIL image -> np.asarray(img, dtype=np.uint8) -> np.rollaxis -> torch.from_numpy into a uint8 batch that the
#   DataLoader pins), used here for a feature-export pass where the labels stay on the host.
# Bug: next() hands self.next_input -- allocated by .cuda()/.float() on the prefetcher's side stream -- to the
#   default stream without input.record_stream(torch.cuda.current_stream()) (the call apex had to add). When the
#   training loop drops the batch, the caching allocator returns its block to the side stream's pool at once, and
#   a later preload() allocates the next normalised batch there and writes it on the side stream while the
#   default stream (lagging behind the host) has not yet read the old batch: side-stream write vs default-stream
#   read of the same device block, freed without record_stream.
# Fix: input.record_stream(torch.cuda.current_stream()) in next(), so the block is not reused until the default
#   stream's work queued before the free has completed.
import io

import numpy as np
import torch
from PIL import Image

BATCH, SIZE, NUM_BATCHES, FEAT = 16, 128, 8, 64


class JpegDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.blobs, self.labels = [], []
        for i in range(n):
            arr = rng.integers(0, 256, size=(SIZE // 8, SIZE // 8, 3), dtype=np.uint8)
            img = Image.fromarray(arr).resize((SIZE, SIZE), Image.Resampling.BILINEAR)
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            self.blobs.append(buf.getvalue())
            self.labels.append(i % 1000)

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, i):
        return Image.open(io.BytesIO(self.blobs[i])).convert("RGB"), self.labels[i]


def fast_collate(batch):
    imgs = [img[0] for img in batch]
    targets = torch.tensor([target[1] for target in batch], dtype=torch.int64)
    w, h = imgs[0].size
    tensor = torch.zeros((len(imgs), 3, h, w), dtype=torch.uint8)
    for i, img in enumerate(imgs):
        nump_array = np.asarray(img, dtype=np.uint8)
        if nump_array.ndim < 3:
            nump_array = np.expand_dims(nump_array, axis=-1)
        nump_array = np.rollaxis(nump_array, 2)
        tensor[i] += torch.from_numpy(nump_array)
    return tensor, targets


class data_prefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.mean = torch.tensor([0.485 * 255, 0.456 * 255, 0.406 * 255]).cuda().view(1, 3, 1, 1)
        self.std = torch.tensor([0.229 * 255, 0.224 * 255, 0.225 * 255]).cuda().view(1, 3, 1, 1)
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input, self.next_target = None, None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_input = self.next_input.float()
            self.next_input = self.next_input.sub_(self.mean).div_(self.std)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        input, target = self.next_input, self.next_target
        self.preload()
        return input, target


def extract_features(model_w, images, simulate_big_model=True):
    if simulate_big_model:
        torch.cuda._sleep(50_000_000)  # the backbone of the real model (slower than JPEG decoding on the host)
    pooled = torch.nn.functional.adaptive_avg_pool2d(images, 8).flatten(1)
    return pooled @ model_w


def main():
    torch.manual_seed(0)
    dataset = JpegDataset(BATCH * NUM_BATCHES)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False, num_workers=0,
                                         pin_memory=True, collate_fn=fast_collate)
    model_w = torch.randn(3 * 64, FEAT, device="cuda:0") / 8.0
    prefetcher = data_prefetcher(loader)
    feats, labels = [], []
    input, target = prefetcher.next()
    while input is not None:
        feats.append(extract_features(model_w, input))
        labels.extend(target.tolist())  # labels never leave the host
        input, target = prefetcher.next()

    torch.cuda.synchronize()
    match = True
    for (cpu_batch, _), got in zip(loader, feats):
        ref_in = cpu_batch.cuda().float().sub_(prefetcher.mean).div_(prefetcher.std)
        match &= bool(torch.allclose(got, extract_features(model_w, ref_in, simulate_big_model=False), atol=1e-4, rtol=1e-4))
    print("batches=%d labels=%d feat_norm=%.3f" % (len(feats), len(labels), torch.stack(feats).norm().item()))
    print("match=%s" % match)


if __name__ == "__main__":
    main()
