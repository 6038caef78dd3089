# Source: torchrec torchrec/distributed/train_pipeline/train_pipelines.py, TrainPipelineBase.progress() with
#         torchrec/distributed/train_pipeline/utils.py _to_device() / _wait_for_batch(): the next batch is
#         copied host->device on self._memcpy_stream (so its tensors are allocated on that stream) and consumed on
#         the default stream; _wait_for_batch does current_stream().wait_stream(memcpy_stream) and then
#         batch.record_stream(cur_stream) "since these tensors were allocated on a different stream". Here the
#         dense arch is a CUDA graph whose static input buffer is refilled from the batch (static_in.copy_(x)).
# Bug: _wait_for_batch() only does the wait_stream and omits batch.record_stream(cur_stream). When the pipeline
#      drops batch i-1, its block returns to the memcpy stream's pool although the default stream's
#      static_in.copy_(batch.dense_features) for it is still queued behind the sparse-arch work; the very next
#      _to_device() on the memcpy stream gets that block and its H2D copy overwrites it: default-stream read
#      vs memcpy-stream write of the reused batch.dense_features block (missing record_stream).
# Fix: _wait_for_batch() calls batch.record_stream(torch.cuda.current_stream()) after the wait_stream.
import torch

DEVICE = torch.device("cuda:0")
SLEEP_CYCLES = 20_000_000  # ~10 ms on an H200
BATCH, DENSE_IN, HIDDEN, NUM_BATCHES = 512, 256, 512, 10


class Batch:
    """Pipelineable: .to() and .record_stream()."""

    def __init__(self, dense_features):
        self.dense_features = dense_features

    def to(self, device, non_blocking):
        return Batch(self.dense_features.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream):
        self.dense_features.record_stream(stream)


def _to_device(batch, device, non_blocking):
    return batch.to(device=device, non_blocking=non_blocking)


def _wait_for_batch(batch, stream):
    if stream is None:
        return
    torch.cuda.current_stream().wait_stream(stream)
    # since these tensors were allocated on a different stream and are going to be used
    # on the current one, let the caching allocator know
    cur_stream = torch.cuda.current_stream()
    batch.record_stream(cur_stream)


class GraphedDenseArch:
    """Dense MLP captured once into a CUDA graph; inputs go through a static buffer."""

    def __init__(self, mlp):
        self.static_in = torch.zeros(BATCH, DENSE_IN, device=DEVICE)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                mlp(self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = mlp(self.static_in)

    def __call__(self, dense_features):
        self.static_in.copy_(dense_features)
        self.graph.replay()
        return self.static_out


class DLRMEval:
    def __init__(self, mlp):
        self.dense_arch = GraphedDenseArch(mlp)

    def __call__(self, batch):
        torch.cuda._sleep(SLEEP_CYCLES)  # stand-in for the sparse arch (embedding lookups + all-to-all)
        return self.dense_arch(batch.dense_features).clone()


class EvalPipelineBase:
    def __init__(self, model, device):
        self._model, self._device = model, device
        self._memcpy_stream = torch.cuda.Stream()
        self._cur_batch = None
        self._connected = False

    def _copy_batch_to_gpu(self, batch):
        with torch.cuda.stream(self._memcpy_stream):
            return _to_device(batch, self._device, non_blocking=True)

    def progress(self, dataloader_iter):
        if not self._connected:
            self._cur_batch = self._copy_batch_to_gpu(next(dataloader_iter))
            self._connected = True
        next_batch = next(dataloader_iter, None)
        cur_batch = self._cur_batch
        _wait_for_batch(cur_batch, self._memcpy_stream)
        output = self._model(cur_batch)
        # copy the next batch to GPU; the last reference to cur_batch goes away here
        self._cur_batch = cur_batch = (self._copy_batch_to_gpu(next_batch) if next_batch is not None else None)
        return output


@torch.no_grad()
def main():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(DENSE_IN, HIDDEN), torch.nn.ReLU(),
                              torch.nn.Linear(HIDDEN, 1)).to(DEVICE)
    host_batches = [Batch(torch.randn(BATCH, DENSE_IN).pin_memory()) for _ in range(NUM_BATCHES)]
    model = DLRMEval(mlp)
    torch.cuda.synchronize()

    pipeline = EvalPipelineBase(model, DEVICE)
    it = iter(host_batches)
    preds = [pipeline.progress(it) for _ in range(NUM_BATCHES)]
    torch.cuda.synchronize()

    ok = all(torch.allclose(p, mlp(b.dense_features.to(DEVICE)), atol=1e-4, rtol=1e-4)
             for p, b in zip(preds, host_batches))
    print(f"batches={len(preds)} match={ok}")


if __name__ == "__main__":
    main()
