# Source: meta-pytorch/torchrec torchrec/distributed/train_pipeline/train_pipelines.py (TrainPipelineSparseDist:
#   `self._memcpy_stream = torch.get_device_module(device).Stream(priority=-1)`, `self._stream_context =
#   torch.get_device_module(self._device).stream`, copy_batch_to_gpu under that context) and
#   torchrec/distributed/train_pipeline/utils.py _to_device / _wait_for_batch (current_stream().wait_stream(stream)
#   followed by `batch.record_stream(cur_stream)`), run as an eval loop over a small DLRM-style model.
# Bug: _wait_for_batch makes the default stream wait for the high-priority memcpy stream but does not call
#   batch.record_stream(current_stream).  The batch tensors are allocated on the memcpy stream, read by the forward
#   on the default stream and then dropped; the caching allocator returns their blocks to the memcpy stream's pool
#   at once, so the H2D copy of batch i+2 (memcpy stream) reuses the block of batch i while the forward of batch i
#   (default stream, queued behind earlier work) has not read it yet: missing record_stream on Batch tensors.
# Fix: _wait_for_batch calls batch.record_stream(torch.get_device_module(device).current_stream()) after the
#   wait_stream, so the freed blocks are not reused until the default stream's queued work is done.
from dataclasses import dataclass

import torch
import torch.nn as nn

DIST_CYCLES = 25_000_000  # input_dist / all-to-all stand-in at the start of every forward


@dataclass
class Batch:
    dense_features: torch.Tensor
    sparse_features: torch.Tensor  # [B, num_features] ids, one id per feature
    labels: torch.Tensor

    def fields(self):
        return (self.dense_features, self.sparse_features, self.labels)

    def to(self, device, non_blocking=False):
        return Batch(*(t.to(device=device, non_blocking=non_blocking) for t in self.fields()))

    def record_stream(self, stream):
        for t in self.fields():
            t.record_stream(stream)

    def pin_memory(self):
        return Batch(*(t.pin_memory() for t in self.fields()))


def _to_device(batch, device, non_blocking):
    return batch.to(device=device, non_blocking=non_blocking)


def _wait_for_batch(batch, stream):
    if stream is None:
        return
    device = stream.device
    torch.get_device_module(device).current_stream().wait_stream(stream)


class DLRMStub(nn.Module):
    def __init__(self, num_embeddings=100_000, num_features=26, dim=64):
        super().__init__()
        self.sparse_arch = nn.EmbeddingBag(num_embeddings, dim, mode="sum")
        self.dense_arch = nn.Sequential(nn.Linear(13, dim), nn.ReLU())
        self.over_arch = nn.Sequential(nn.Linear(2 * dim, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, batch):
        torch.cuda._sleep(DIST_CYCLES)
        sparse = self.sparse_arch(batch.sparse_features)
        dense = self.dense_arch(batch.dense_features)
        logits = self.over_arch(torch.cat([dense, sparse], dim=1)).squeeze(1)
        return torch.sigmoid(logits), batch.labels


class EvalPipelineSparseDist:
    def __init__(self, model, device):
        self._model = model
        self._device = device
        self._memcpy_stream = (
            torch.get_device_module(device).Stream(priority=-1) if device.type in ["cuda", "mtia"] else None
        )
        self._stream_context = (
            torch.get_device_module(device).stream if device.type in ["cuda", "mtia"] else torch.cuda.stream
        )
        self._cur_batch = None
        self._connected = False

    def _copy_batch_to_gpu(self, dataloader_iter):
        with self._stream_context(self._memcpy_stream):
            batch = next(dataloader_iter, None)
            if batch is not None:
                batch = _to_device(batch, self._device, non_blocking=True)
            return batch

    @torch.no_grad()
    def progress(self, dataloader_iter):
        if not self._connected:
            self._cur_batch = self._copy_batch_to_gpu(dataloader_iter)
            self._connected = True
        cur_batch = self._cur_batch
        if cur_batch is None:
            raise StopIteration
        _wait_for_batch(cur_batch, self._memcpy_stream)
        output = self._model(cur_batch)
        self._cur_batch = self._copy_batch_to_gpu(dataloader_iter)
        return output


def make_batches(n, batch_size=2048, num_features=26, num_embeddings=100_000):
    g = torch.Generator().manual_seed(0)
    return [
        Batch(
            torch.randn(batch_size, 13, generator=g),
            torch.randint(0, num_embeddings, (batch_size, num_features), generator=g),
            torch.randint(0, 2, (batch_size,), generator=g).float(),
        ).pin_memory()
        for _ in range(n)
    ]


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = DLRMStub().to(device).eval()
    batches = make_batches(8)

    pipeline = EvalPipelineSparseDist(model, device)
    it = iter(batches)
    results = []
    while True:
        try:
            results.append(pipeline.progress(it))
        except StopIteration:
            break

    torch.cuda.synchronize(device)
    ok = True
    with torch.no_grad():
        for batch, (pred, labels) in zip(batches, results):
            ref_pred, ref_labels = model(batch.to(device))
            ok &= torch.allclose(pred, ref_pred, atol=1e-5) and torch.equal(labels, ref_labels)
    print(f"batches: {len(results)}")
    print(f"match={ok}")


if __name__ == "__main__":
    main()
