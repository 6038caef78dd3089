# Source: plausible pattern modelled on bucketed weight updates for RL rollout
# engines (e.g. MoonshotAI checkpoint-engine's pinned-memory buckets, verl /
# slime update_weights_from_tensor with flattened buckets): a receiver thread
# pulls the next bucket of trainer weights into a reusable pinned staging
# buffer, and the engine copies the staging buffer into its flat parameter
# storage with a non_blocking H2D copy on a dedicated update stream.
#
# Race (host-device, write-after-read, across threads): the engine thread hands
# the staging buffer back to the receiver (releases the `free` semaphore) as
# soon as the H2D copy is *enqueued*; the receiver thread then overwrites the
# pinned buffer with the next bucket (staging.copy_(bucket)) while the DMA,
# queued behind other work on the update stream, may not have read it yet ->
# bucket b is loaded (partly) with bucket b+1's bytes.
# Fix: wait for the copy's CUDA event (copy_done.synchronize()) before handing
# the staging buffer back to the receiver.
import threading

import torch

DEV = "cuda:0"
BUCKET_NUMEL, N_BUCKETS = 1 << 20, 8  # 8 buckets of 4 MiB (fp32)
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait: other transfers queued first


class BucketReceiver(threading.Thread):
    """Receives trainer weight buckets (here: from CPU tensors) into `staging`."""

    def __init__(self, staging, buckets):
        super().__init__(daemon=True)
        self.staging = staging
        self.buckets = buckets
        self.free = threading.Semaphore(1)  # staging may be overwritten
        self.full = threading.Semaphore(0)  # staging holds the next bucket

    def run(self):
        for bucket in self.buckets:
            self.free.acquire()
            self.staging.copy_(bucket)  # host write into the pinned staging buffer
            self.full.release()


class RolloutEngine:
    def __init__(self):
        self.flat_params = torch.randn(N_BUCKETS * BUCKET_NUMEL, device=DEV)  # old weights
        self.staging = torch.empty(BUCKET_NUMEL).pin_memory()
        self.update_stream = torch.cuda.Stream()
        self.copy_done = torch.cuda.Event()

    def update_weights(self, receiver):
        # in-flight generation on the default stream still reads flat_params
        self.update_stream.wait_stream(torch.cuda.current_stream())
        for b in range(N_BUCKETS):
            receiver.full.acquire()
            with torch.cuda.stream(self.update_stream):
                torch.cuda._sleep(SLEEP_CYCLES)
                dst = self.flat_params[b * BUCKET_NUMEL:(b + 1) * BUCKET_NUMEL]
                dst.copy_(self.staging, non_blocking=True)
                self.copy_done.record()
            # BUG: the H2D copy may not have read `staging` yet.
            receiver.free.release()
        torch.cuda.current_stream().wait_stream(self.update_stream)

    def generate(self, x):
        w = self.flat_params.view(N_BUCKETS * 4, 512, 512)[:4]
        for i in range(w.shape[0]):
            x = torch.tanh(x @ w[i] / 512 ** 0.5)
        return x


@torch.no_grad()
def main():
    torch.manual_seed(0)
    trainer_buckets = [torch.randn(BUCKET_NUMEL) for _ in range(N_BUCKETS)]
    engine = RolloutEngine()
    x = torch.randn(64, 512, device=DEV)
    acc = torch.zeros((), dtype=torch.float64, device=DEV)
    acc += engine.generate(x).double().sum()  # rollout with the old weights

    receiver = BucketReceiver(engine.staging, trainer_buckets)
    receiver.start()
    engine.update_weights(receiver)
    receiver.join()

    acc += engine.generate(x).double().sum() * 2  # rollout with the new weights
    w = torch.arange(N_BUCKETS * BUCKET_NUMEL, device=DEV, dtype=torch.float64) % 997
    acc += (engine.flat_params.double() * w).sum()
    torch.cuda.synchronize()
    print(f"rl_bucket_staging_thread checksum: {acc.item():.6f}")


if __name__ == "__main__":
    main()
