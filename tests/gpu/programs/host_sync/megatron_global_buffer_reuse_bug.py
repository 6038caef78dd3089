# Source: NVIDIA/Megatron-LM megatron/core/utils.py, GlobalMemoryBuffer.get_tensor(shape, dtype, name):
#   "Global buffer to avoid dynamic memory allocations. Caller should ensure that buffers of the same
#   name are not used concurrently." Modelled use (plausible pattern): Megatron-style training_log()
#   packs the per-step logging scalars into a named global buffer and ships it to the host on a
#   separate logging stream. The buffer is recycled by this Python-level pool, which the CUDA caching
#   allocator cannot see, so nothing orders the next step's reuse after the logging stream's read.
import operator
from functools import reduce

import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms: the logging stream is behind (e.g. still flushing earlier stats)
DEVICE = torch.device("cuda", 0)
NUM_STEPS = 6
NUM_STATS = 4


class GlobalMemoryBuffer:
    def __init__(self):
        self.buffer = {}
        self.last_use = {}  # (name, dtype) -> event recorded where the previous user finished

    def get_tensor(self, tensor_shape, dtype, name):
        required_len = reduce(operator.mul, tensor_shape, 1)
        key = (name, dtype)
        if self.buffer.get(key) is None or self.buffer[key].numel() < required_len:
            self.buffer[key] = torch.empty(required_len, dtype=dtype, device=DEVICE)
        return self.buffer[key][0:required_len].view(*tensor_shape)

    def release(self, name, dtype, stream):
        event = torch.cuda.Event()
        event.record(stream)
        self.last_use[(name, dtype)] = event


_GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def get_global_memory_buffer():
    return _GLOBAL_MEMORY_BUFFER


class AsyncStatsLogger:
    """Ships packed stats to pinned host memory on its own stream; reads them at flush time."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.pending = []

    def log(self, packed, name):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        get_global_memory_buffer().release(name, packed.dtype, self.stream)
        self.pending.append((done, host))

    def flush(self):
        rows = []
        for done, host in self.pending:
            done.synchronize()
            rows.append(host.tolist())
        self.pending.clear()
        return rows


def training_log(loss, grad_norm, lr, num_tokens, logger, reference):
    stats = get_global_memory_buffer().get_tensor((NUM_STATS,), torch.float32, "training_log")
    torch.stack([loss, grad_norm, lr, num_tokens], out=stats)
    reference.append(stats.clone())
    logger.log(stats, "training_log")


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = [(torch.randn(1024, 512, device=DEVICE), torch.randn(1024, 1, device=DEVICE)) for _ in range(NUM_STEPS)]
    torch.cuda.synchronize()

    logger = AsyncStatsLogger()
    reference = []
    for step, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        opt.step()
        lr = torch.full((), opt.param_groups[0]["lr"], device=DEVICE)
        num_tokens = torch.full((), float(x.shape[0] * (step + 1)), device=DEVICE)
        training_log(loss.detach(), grad_norm, lr, num_tokens, logger, reference)

    rows = logger.flush()
    torch.cuda.synchronize()
    expected = [r.tolist() for r in reference]
    checksum = sum(sum(r) for r in rows)
    ref_sum = sum(sum(r) for r in expected)
    match = rows == expected
    print(f"checksum={checksum:.6f} reference={ref_sum:.6f} match={match}")


if __name__ == "__main__":
    main()
