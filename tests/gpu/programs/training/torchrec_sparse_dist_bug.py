# TorchRec TrainPipelineSparseDist: memcpy stream + data-dist stream + record_stream (BUG version).
# Source: pytorch/torchrec torchrec/distributed/train_pipeline/train_pipelines.py
#   (TrainPipelineSparseDist: stage 1 device transfer on memcpy stream, stage 2 input_dist on the
#   data_dist stream, stage 3 forward/backward on the default stream) and
#   torchrec/distributed/train_pipeline/utils.py::_wait_for_batch, which does
#   current_stream().wait_stream(stream) and batch.record_stream(current_stream) because the batch
#   was allocated on another stream.  It relies on the Pipelineable batch's record_stream() to cover
#   every tensor (torchrec/datasets/utils.py::Batch records dense_features, sparse_features and
#   labels).  Missing record_stream calls caused NaNs / IMAs in torchrec (PR #2598, PR #4231).
#   Plausible pattern modelled here: a user Batch whose record_stream() forgets the labels field.
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("cuda:0")
B, DENSE, IDS_PER_SAMPLE, NUM_EMB, EMB_DIM = 256, 64, 8, 1000, 32


@dataclass
class Batch:  # implements torchrec.streamable.Pipelineable
    dense: torch.Tensor
    ids: torch.Tensor       # KJT values (one feature)
    lengths: torch.Tensor   # KJT lengths
    labels: torch.Tensor

    def to(self, device, non_blocking=False):
        return Batch(self.dense.to(device, non_blocking=non_blocking),
                     self.ids.to(device, non_blocking=non_blocking),
                     self.lengths.to(device, non_blocking=non_blocking),
                     self.labels.to(device, non_blocking=non_blocking))

    def record_stream(self, stream):
        self.dense.record_stream(stream)
        self.ids.record_stream(stream)
        self.lengths.record_stream(stream)


@dataclass
class DistOut:  # output of the sparse input_dist (KJTList-like), Multistreamable
    values: torch.Tensor
    offsets: torch.Tensor

    def record_stream(self, stream):
        self.values.record_stream(stream)
        self.offsets.record_stream(stream)


def _to_device(batch, device, non_blocking):
    return batch.to(device=device, non_blocking=non_blocking)


def _wait_for_batch(batch, stream):
    if stream is None:
        return
    torch.cuda.current_stream().wait_stream(stream)
    cur_stream = torch.cuda.current_stream()
    batch.record_stream(cur_stream)


class SparseArch(nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = nn.EmbeddingBag(NUM_EMB, EMB_DIM, mode="sum")

    def input_dist(self, ids, lengths):  # runs on the data_dist stream
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=ids.device)
        offsets[1:] = torch.cumsum(lengths, 0)
        return DistOut(torch.remainder(ids, NUM_EMB), offsets)

    def forward(self, dist_out):
        return self.ebc(dist_out.values, dist_out.offsets[:-1])


class DLRM(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = SparseArch()
        self.dense_arch = nn.Sequential(nn.Linear(DENSE, EMB_DIM), nn.ReLU())
        self.over = nn.Sequential(nn.Linear(2 * EMB_DIM, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, batch, dist_out):
        d = self.dense_arch(batch.dense)
        s = self.sparse(dist_out)
        logits = self.over(torch.cat([d, s], dim=1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


class TrainPipelineSparseDist:
    def __init__(self, model, optimizer, device):
        self._model, self._optimizer, self._device = model, optimizer, device
        self._memcpy_stream = torch.cuda.Stream(priority=-1)
        self._data_dist_stream = torch.cuda.Stream(priority=-1)
        self._batch_i = self._batch_ip1 = self._batch_ip2 = None
        self._dist_i = self._dist_ip1 = None

    def _copy_batch_to_gpu(self, dataloader_iter):
        with torch.cuda.stream(self._memcpy_stream):
            batch = next(dataloader_iter, None)
            if batch is not None:
                batch = _to_device(batch, self._device, non_blocking=True)
        return batch

    def _start_sparse_data_dist(self, batch):
        if batch is None:
            return None
        with torch.cuda.stream(self._data_dist_stream):
            _wait_for_batch(batch, self._memcpy_stream)
            return self._model.sparse.input_dist(batch.ids, batch.lengths)

    def progress(self, dataloader_iter):
        if self._batch_i is None and self._batch_ip1 is None:  # fill pipeline
            self._batch_i = self._copy_batch_to_gpu(dataloader_iter)
            self._dist_i = self._start_sparse_data_dist(self._batch_i)
            self._batch_ip1 = self._copy_batch_to_gpu(dataloader_iter)
        if self._batch_i is None:
            raise StopIteration
        _wait_for_batch(self._batch_i, self._data_dist_stream)
        self._dist_ip1 = self._start_sparse_data_dist(self._batch_ip1)
        self._batch_ip2 = self._copy_batch_to_gpu(dataloader_iter)
        # PipelinedForward: the input_dist output was produced on the data_dist stream
        self._dist_i.record_stream(torch.cuda.current_stream())
        self._optimizer.zero_grad()
        loss, output = self._model(self._batch_i, self._dist_i)
        loss.backward()
        self._optimizer.step()
        self._batch_i, self._dist_i = self._batch_ip1, self._dist_ip1
        self._batch_ip1 = self._batch_ip2
        return output


def make_dataset(n):
    data = []
    for _ in range(n):
        data.append(Batch(torch.randn(B, DENSE).pin_memory(),
                          torch.randint(0, 10 * NUM_EMB, (B * IDS_PER_SAMPLE,)).pin_memory(),
                          torch.full((B,), IDS_PER_SAMPLE, dtype=torch.int64).pin_memory(),
                          torch.randint(0, 2, (B,)).float().pin_memory()))
    return data


def main():
    torch.manual_seed(0)
    model = DLRM().to(DEV)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = TrainPipelineSparseDist(model, optimizer, DEV)
    it = iter(make_dataset(8))
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            break
    torch.cuda.synchronize()
    print("steps", len(outputs), "mean logit", round(torch.stack(outputs).mean().item(), 5))


if __name__ == "__main__":
    main()
