# snapshot_query (FIXED version)
# Source: asynchronous weight snapshots staged to pinned memory on a side stream
# and persisted once a CUDA event is seen complete by polling (the pattern of
# async checkpoint staging, e.g. torch.distributed.checkpoint's async_save with
# pinned staging buffers). The misuse of Stream.record_event() is a plausible
# pattern, not a specific reported issue.
# Semantics: Stream.record_event(event=None) records and RETURNS a new event; the
# event object the host later polls was never recorded, and
# torch.cuda.Event.query() returns True for a never-recorded event
# (c10/cuda/CUDAEvent.h `if (!is_created_) return true;`, pytorch/pytorch PR
# #49343 "an empty event is always ready", eyalroz/cuda-api-wrappers issue #226).
import numpy as np
import torch
import torch.nn.functional as F

torch.manual_seed(0)
DEV = torch.device("cuda:0")
BATCH, FEAT, STEPS = 256, 1024, 6


class AsyncSnapshot:
    """Flat copy of the weights -> pinned host memory, persisted when ready."""

    def __init__(self, params):
        self.params = list(params)
        numel = sum(p.numel() for p in self.params)
        self.stream = torch.cuda.Stream()
        self.snap = torch.empty(numel, device=DEV)           # device staging
        self.host = torch.empty(numel, pin_memory=True)      # pinned target
        self.done = torch.cuda.Event(blocking=True)
        self.saved = []

    def start(self):
        main = torch.cuda.current_stream()
        main.wait_stream(self.stream)             # last D2H finished reading snap
        torch.cat([p.detach().reshape(-1) for p in self.params], out=self.snap)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            self.host.copy_(self.snap, non_blocking=True)    # D2H on side stream
            # FIX: record self.done itself; polling query() until True then
            # orders the host after the D2H copy.
            self.stream.record_event(self.done)

    def persist(self):
        while not self.done.query():              # "wait without blocking"
            pass
        view = self.host.numpy()                  # numpy view of pinned memory
        self.saved.append(float(view.sum(dtype=np.float64)))  # host reads it


def main():
    model = torch.nn.Sequential(
        torch.nn.Linear(FEAT, FEAT), torch.nn.GELU(), torch.nn.Linear(FEAT, FEAT)
    ).to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    snapshot = AsyncSnapshot(model.parameters())
    for step in range(STEPS):
        x = torch.randn(BATCH, FEAT, device=DEV)
        loss = F.mse_loss(model(x), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 2 == 1:
            snapshot.start()
            snapshot.persist()
    torch.cuda.synchronize()
    print("snapshots", len(snapshot.saved), "last", snapshot.saved[-1])


if __name__ == "__main__":
    main()
