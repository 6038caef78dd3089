# Source: NVIDIA apex examples/imagenet/main_amp.py, class data_prefetcher (preload() copies the next batch with
#   .cuda(non_blocking=True) and normalizes it in place inside `with torch.cuda.stream(self.stream)`; next() does
#   current_stream().wait_stream(self.stream) and input.record_stream(current_stream())); the same pattern is
#   torchtnt's CudaDataPrefetcher + record_data_in_stream. Batches here are length-bucketed speech features whose
#   length grows batch to batch (sorted-by-duration sampling, as in NeMo/ESPnet ASR), and the program runs with
#   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
# Bug: next() hands the prefetched batch to the default stream without record_stream. The batch was allocated on
#   the prefetch stream, so when the training loop drops it the block goes back to that stream's pool with only the
#   prefetch stream's own uses known. With expandable segments all of the prefetch stream's batches live in one
#   growing segment, so the freed ranges of the two previous batches merge and the next, larger batch is placed over
#   them; its H2D copy and in-place normalization on the prefetch stream overwrite features that the model on the
#   default stream has not read yet. (Without expandable segments each >10 MiB batch gets its own segment and the
#   larger batch usually does not fit the hole: the same missing edge, but latent.)
# Fix: next() calls input.record_stream(torch.cuda.current_stream()), as apex does. (Only the features are
#   prefetched here; the utterance ids stay on the host.)
import os

os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402

BATCH, N_MELS, HIDDEN, STEPS = 16, 80, 512, 10
MODEL_DELAY = 20_000_000          # cycles of encoder work per step on the default stream
FEAT_MEAN, FEAT_STD = 0.5, 2.0


def make_loader():
    """Length-sorted batches of log-mel features, pinned by the DataLoader's pin_memory thread."""
    batches = []
    for k in range(STEPS):
        frames = 2400 + 96 * k                     # 12.3 MiB .. 16.7 MiB of fp32 features
        feats = torch.randn(BATCH, frames, N_MELS) * FEAT_STD + FEAT_MEAN
        batches.append(feats.pin_memory())
    return batches


class data_prefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.preload()

    def preload(self):
        try:
            self.next_input = next(self.loader)
        except StopIteration:
            self.next_input = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_input = self.next_input.sub_(FEAT_MEAN).div_(FEAT_STD)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        input = self.next_input
        self.preload()
        return input


def encoder_step(feats, w):
    torch.cuda._sleep(MODEL_DELAY)
    hidden = torch.tanh(feats @ w)                 # (B, T, HIDDEN)
    return hidden.mean(dim=(1, 2))


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    loader = make_loader()
    w = torch.randn(N_MELS, HIDDEN, device=dev) / N_MELS ** 0.5
    torch.cuda.synchronize()

    prefetcher = data_prefetcher(loader)
    outputs = []
    input = prefetcher.next()
    while input is not None:
        outputs.append(encoder_step(input, w))
        input = prefetcher.next()
    torch.cuda.synchronize()

    ok = True
    for feats, out in zip(loader, outputs):
        x = (feats.to(dev) - FEAT_MEAN) / FEAT_STD
        ref = torch.tanh(x @ w).mean(dim=(1, 2))
        ok = ok and torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    print(f"match={ok}")


if __name__ == "__main__":
    main()
