# Case: GraphSAGE mini-batch training with neighbour-sampled subgraphs fed through PyG's
# PrefetchLoader, which copies the next batch to the GPU on a side stream.
# Source: pyg-team/pytorch_geometric torch_geometric/loader/prefetch.py (DeviceHelper +
#   PrefetchLoader, re-created verbatim in structure). The batch tensors are allocated on the
#   prefetch stream by `batch.to(device, non_blocking=True)`, consumed on the default stream and
#   dropped without record_stream(). NVIDIA apex's imagenet data_prefetcher (examples/imagenet/
#   main_amp.py) calls `input.record_stream(torch.cuda.current_stream())` for exactly this reason.
#   No PyG issue about it was found: the missing record_stream is our reading of the code.
# FIXED: every batch tensor is record_stream()'d on the consumer (default) stream when it is handed
#   out; the allocator then records an event on that stream when the batch is freed and reuses the
#   blocks only after it has completed.
from contextlib import nullcontext
from functools import partial
import torch
import torch.nn as nn
import torch.nn.functional as F


class Data:
    """Minimal torch_geometric.data.Data: pin_memory()/to() apply to every tensor attribute."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def apply(self, fn):
        return Data(**{k: fn(v) if torch.is_tensor(v) else v for k, v in self.__dict__.items()})

    def pin_memory(self):
        return self.apply(lambda t: t.pin_memory())

    def to(self, device, non_blocking=False):
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))


class DeviceHelper:
    def __init__(self, device=None):
        self.device = torch.device(device or "cuda")
        self.is_gpu = self.device.type == "cuda"
        self.stream = None
        self.stream_context = nullcontext
        self.module = torch.cuda if self.is_gpu else None

    def maybe_init_stream(self):
        if self.is_gpu:
            self.stream = self.module.Stream()
            self.stream_context = partial(self.module.stream, stream=self.stream)

    def maybe_wait_stream(self):
        if self.stream is not None:
            self.module.current_stream().wait_stream(self.stream)

    def maybe_record_stream(self, batch):  # FIX, as apex's data_prefetcher
        if self.stream is not None:
            for v in batch.__dict__.values():
                if torch.is_tensor(v):
                    v.record_stream(self.module.current_stream())


class PrefetchLoader:
    def __init__(self, loader, device=None):
        self.loader = loader
        self.device_helper = DeviceHelper(device)

    def non_blocking_transfer(self, batch):
        if not self.device_helper.is_gpu:
            return batch
        batch = batch.pin_memory()
        return batch.to(self.device_helper.device, non_blocking=True)

    def __iter__(self):
        first = True
        self.device_helper.maybe_init_stream()
        for next_batch in self.loader:
            with self.device_helper.stream_context():
                next_batch = self.non_blocking_transfer(next_batch)
            if not first:
                yield batch  # noqa: F821
            else:
                first = False
            self.device_helper.maybe_wait_stream()
            self.device_helper.maybe_record_stream(next_batch)
            batch = next_batch
        yield batch


class FixedFanoutNeighborLoader:
    """CPU neighbour sampler: each seed node gets exactly `fanout` sampled neighbours."""

    def __init__(self, x, y, rowptr, col, batch_size, fanout, num_batches, seed=0):
        self.x, self.y, self.rowptr, self.col = x, y, rowptr, col
        self.batch_size, self.fanout, self.num_batches = batch_size, fanout, num_batches
        self.g = torch.Generator().manual_seed(seed)

    def __iter__(self):
        n = self.x.shape[0]
        for _ in range(self.num_batches):
            seeds = torch.randint(0, n, (self.batch_size,), generator=self.g)
            deg = self.rowptr[seeds + 1] - self.rowptr[seeds]
            off = (torch.rand(self.batch_size, self.fanout, generator=self.g) * deg[:, None]).long()
            nbrs = self.col[self.rowptr[seeds][:, None] + off].flatten()
            n_id = torch.cat([seeds, nbrs])
            src = torch.arange(self.batch_size, n_id.numel())
            dst = torch.arange(self.batch_size).repeat_interleave(self.fanout)
            yield Data(x=self.x[n_id], edge_index=torch.stack([src, dst]), y=self.y[seeds],
                       batch_size=self.batch_size)


class SAGEConv(nn.Module):
    def __init__(self, cin, cout, fanout):
        super().__init__()
        self.fanout = fanout
        self.lin_l, self.lin_r = nn.Linear(cin, cout), nn.Linear(cin, cout, bias=False)

    def forward(self, x, edge_index, num_dst):
        msg = x[edge_index[0]].view(num_dst, self.fanout, -1).mean(1)  # edges sorted by dst
        return self.lin_l(msg) + self.lin_r(x[:num_dst])


def main():
    torch.manual_seed(0)
    num_nodes, feat, classes, fanout = 20000, 128, 16, 10
    deg = torch.randint(1, 30, (num_nodes,), generator=torch.Generator().manual_seed(1))
    rowptr = torch.cat([torch.zeros(1, dtype=torch.long), deg.cumsum(0)])
    col = torch.randint(0, num_nodes, (int(rowptr[-1]),), generator=torch.Generator().manual_seed(2))
    x, y = torch.randn(num_nodes, feat), torch.randint(0, classes, (num_nodes,))
    loader = PrefetchLoader(FixedFanoutNeighborLoader(x, y, rowptr, col, 1024, fanout, 12), "cuda")
    conv = SAGEConv(feat, 256, fanout).cuda()
    head = nn.Linear(256, classes).cuda()
    params = list(conv.parameters()) + list(head.parameters())
    total_loss = torch.zeros((), device="cuda")
    for batch in loader:
        h = F.relu(conv(batch.x, batch.edge_index, batch.batch_size))
        loss = F.cross_entropy(head(h), batch.y)
        loss.backward()
        with torch.no_grad():  # plain SGD step
            for p in params:
                p.add_(p.grad, alpha=-0.01)
                p.grad = None
        total_loss += loss.detach()  # no host sync inside the loop
    print("mean loss", (total_loss / 12).item())


if __name__ == "__main__":
    main()
