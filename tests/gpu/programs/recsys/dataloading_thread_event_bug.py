# Source: pytorch/torchrec torchrec/distributed/train_pipeline/utils.py (DataLoadingThread: a background
#   thread copies the next batch to the GPU on its own low-priority memcpy stream and hands it to the
#   training thread through a one-slot buffer; the training stream must then be ordered after that copy,
#   cf. _wait_for_batch in the same file).
"""A data-loading thread that issues batch H2D copies on its own memcpy stream and passes each batch
with a CUDA event that marks "copy finished" to the training loop on the main thread."""
import copy
import queue
import threading

import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000
DEV = torch.device("cuda", 0)
B, NUM_DENSE, BAG, NUM_ROWS, DIM, NUM_BATCHES = 2048, 32, 4, 10_000, 32, 6


class DataLoadingThread(threading.Thread):
    def __init__(self, host_batches):
        super().__init__(name="DataLoadingThread", daemon=True)
        low_priority, _ = torch.cuda.Stream.priority_range()
        self._memcpy_stream = torch.cuda.Stream(priority=low_priority)
        self._host_batches = host_batches
        self._buffer = queue.Queue(maxsize=1)

    def run(self):
        torch.cuda.set_device(DEV)
        for host_batch in self._host_batches:
            with torch.cuda.stream(self._memcpy_stream):
                # the low-priority copy stream is behind other transfers
                torch.cuda._sleep(SLEEP_CYCLES)
                batch = {k: v.to(DEV, non_blocking=True) for k, v in host_batch.items()}
            copy_done = torch.cuda.Event()
            copy_done.record()
            self._buffer.put((batch, copy_done))
        self._buffer.put(None)

    def get_next_batch(self):
        return self._buffer.get()


class TinyDLRM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(NUM_ROWS, DIM) * 0.05)
        self.bottom = torch.nn.Linear(NUM_DENSE, DIM)
        self.top = torch.nn.Linear(2 * DIM, 1)

    def forward(self, batch):
        ids = torch.remainder(batch["ids"], NUM_ROWS)  # hashing into the table
        pooled = self.table.index_select(0, ids).view(-1, BAG, DIM).sum(1)
        x = torch.cat([torch.relu(self.bottom(batch["dense"])), pooled], dim=1)
        return F.binary_cross_entropy_with_logits(self.top(x).squeeze(1), batch["labels"])


def train_step(model, optimizer, batch):
    loss = model(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    host_batches = [{
        "dense": torch.randn(B, NUM_DENSE, generator=g).pin_memory(),
        "ids": torch.randint(0, 1 << 30, (B * BAG,), generator=g).pin_memory(),
        "labels": torch.randint(0, 2, (B,), generator=g).float().pin_memory(),
    } for _ in range(NUM_BATCHES)]
    model = TinyDLRM().to(DEV)
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.cuda.synchronize()

    loader = DataLoadingThread(host_batches)
    loader.start()
    losses = []
    while (item := loader.get_next_batch()) is not None:
        batch, copy_done = item
        cur = torch.cuda.current_stream()
        cur.wait_event(copy_done)
        for t in batch.values():
            t.record_stream(cur)
        losses.append(train_step(model, optimizer, batch))
        del batch, item
    loader.join()
    got = torch.stack(losses)
    torch.cuda.synchronize()

    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref = torch.stack([
        train_step(ref_model, ref_optimizer, {k: v.to(DEV) for k, v in hb.items()})
        for hb in host_batches
    ])
    torch.cuda.synchronize()
    match = torch.allclose(got, ref, rtol=1e-3, atol=1e-4)
    checksum, ref_checksum = got.sum().item(), ref.sum().item()
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={ref_checksum:.6f} match={match}")


if __name__ == "__main__":
    main()
