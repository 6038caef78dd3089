# Source: pytorch/torchrec torchrec/distributed/train_pipeline/train_pipelines.py (TrainPipelineSparseDist:
#   batch H2D on a memcpy stream, input dist on a data_dist stream, batch i+2 copied while batch i trains)
#   and torchrec/distributed/train_pipeline/utils.py (_wait_for_batch: wait_stream + batch.record_stream,
#   whose docstring explains why the caching allocator needs the record_stream).
"""A small TrainPipelineSparseDist: three stages on three streams.

stage 1 (memcpy stream):    H2D copy of batch i+2 from pinned host memory
stage 2 (data_dist stream): "input dist" of batch i+1 (ids hashed to local rows)
stage 3 (default stream):   forward / backward / optimizer of batch i
"""
import copy
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000
DEV = torch.device("cuda", 0)
B, NUM_DENSE, BAG, NUM_ROWS, DIM, NUM_BATCHES = 1024, 64, 8, 4096, 32, 8


@dataclass
class Batch:
    dense: torch.Tensor   # [B, NUM_DENSE] float32
    ids: torch.Tensor     # [B * BAG] int64, raw feature ids
    labels: torch.Tensor  # [B] float32

    def to(self, device, non_blocking):
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.ids.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream):
        for t in (self.dense, self.ids, self.labels):
            t.record_stream(stream)


@dataclass
class Context:
    index: int
    local_ids: Optional[torch.Tensor] = None  # output of the input dist

    def record_stream(self, stream):
        self.local_ids.record_stream(stream)


def input_dist(ids):
    # stands in for the KJT all-to-all: hash raw ids onto this rank's rows
    return torch.remainder(ids * 2654435761, NUM_ROWS)


class SparseArch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(NUM_ROWS, DIM) * 0.05)
        self.bottom = torch.nn.Linear(NUM_DENSE, DIM)
        self.top = torch.nn.Linear(2 * DIM, 1)

    def forward(self, dense, local_ids, labels):
        pooled = self.table.index_select(0, local_ids).view(-1, BAG, DIM).sum(1)
        logits = self.top(torch.cat([torch.relu(self.bottom(dense)), pooled], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, labels)


class TrainPipelineSparseDist:
    def __init__(self, model, optimizer):
        self._model = model
        self._optimizer = optimizer
        self._memcpy_stream = torch.cuda.Stream(priority=-1)
        self._data_dist_stream = torch.cuda.Stream(priority=-1)
        self._batches = deque()
        self._contexts = deque()
        self._next_index = 0
        self._connected = False

    def _copy_batch_to_gpu(self, dataloader_iter):
        with torch.cuda.stream(self._memcpy_stream):
            batch = next(dataloader_iter, None)
            if batch is None:
                return None
            return batch.to(DEV, non_blocking=True)

    def enqueue_batch(self, dataloader_iter):
        batch = self._copy_batch_to_gpu(dataloader_iter)
        if batch is None:
            return False
        self._batches.append(batch)
        self._contexts.append(Context(index=self._next_index))
        self._next_index += 1
        return True

    def start_sparse_data_dist(self, batch, context):
        with torch.cuda.stream(self._data_dist_stream):
            self._data_dist_stream.wait_stream(self._memcpy_stream)
            batch.ids.record_stream(self._data_dist_stream)
            context.local_ids = input_dist(batch.ids)

    def wait_sparse_data_dist(self, context):
        cur = torch.cuda.current_stream()
        cur.wait_stream(self._data_dist_stream)
        context.record_stream(cur)

    def _wait_for_batch(self, batch):
        cur = torch.cuda.current_stream()
        cur.wait_stream(self._memcpy_stream)
        # FIX: tell the allocator the default stream uses the batch, so its blocks are not reused early
        batch.record_stream(cur)

    def fill_pipeline(self, dataloader_iter):
        if self.enqueue_batch(dataloader_iter):
            self.start_sparse_data_dist(self._batches[0], self._contexts[0])
            self.enqueue_batch(dataloader_iter)
        self._connected = True

    def progress(self, dataloader_iter):
        if not self._connected:
            self.fill_pipeline(dataloader_iter)
        if not self._batches:
            raise StopIteration
        # H2D of batch i+2 overlaps with this iteration
        self.enqueue_batch(dataloader_iter)

        batch, context = self._batches[0], self._contexts[0]
        self._wait_for_batch(batch)
        self.wait_sparse_data_dist(context)
        if len(self._batches) > 1:
            self.start_sparse_data_dist(self._batches[1], self._contexts[1])

        # the dense forward of batch i is queued behind earlier default-stream work
        torch.cuda._sleep(SLEEP_CYCLES)
        loss = self._model(batch.dense, context.local_ids, batch.labels)
        loss.backward()
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)

        self._batches.popleft()
        self._contexts.popleft()
        return loss.detach()


def make_host_batches():
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(NUM_BATCHES):
        batches.append(Batch(
            torch.randn(B, NUM_DENSE, generator=g).pin_memory(),
            torch.randint(0, 1 << 30, (B * BAG,), generator=g).pin_memory(),
            torch.randint(0, 2, (B,), generator=g).float().pin_memory(),
        ))
    return batches


def reference_losses(model, host_batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for hb in host_batches:
        b = hb.to(DEV, non_blocking=False)
        loss = model(b.dense, input_dist(b.ids), b.labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def main():
    torch.manual_seed(0)
    host_batches = make_host_batches()  # kept alive: pinned sources are never freed early
    model = SparseArch().to(DEV)
    ref_model = copy.deepcopy(model)
    torch.cuda.synchronize()

    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.05))
    dataloader_iter = iter(host_batches)
    losses = []
    while True:
        try:
            losses.append(pipeline.progress(dataloader_iter))
        except StopIteration:
            break
    got = torch.stack(losses)
    torch.cuda.synchronize()

    ref = reference_losses(ref_model, host_batches)
    torch.cuda.synchronize()
    match = len(losses) == NUM_BATCHES and torch.allclose(got, ref, rtol=1e-3, atol=1e-4)
    checksum, ref_checksum = got.sum().item(), ref.sum().item()
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={ref_checksum:.6f} match={match}")


if __name__ == "__main__":
    main()
