# Source: NVIDIA/Megatron-LM megatron/core/pipeline_parallel/pinned_activation_buffer.py
#   (PinnedActivationBuffer: a fixed pinned buffer that is reused only "after waiting for its
#   H2D readers") and pytorch/tutorials PR #2983 (intermediate_source/pinmem_nonblock.py: a
#   non_blocking H2D copy out of pinned memory returns before the host buffer has been read).
# Pattern: host-side feeder of the first pipeline stage. Micro-batches produced by NumPy are
#   staged through a double-buffered ring of pinned host slots, uploaded with non_blocking
#   copies on a dedicated copy stream, and consumed by the stage stream after an event.
import contextlib

import numpy as np
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DEV = torch.device("cuda", 0)
N_MICRO = 6
ROWS, DIM = 1024, 1024


class PinnedStagingRing:
    def __init__(self, shape, n_slots=2):
        self.slots = [torch.empty(shape, dtype=torch.float32, pin_memory=True) for _ in range(n_slots)]
        self.uploaded = [None] * n_slots  # event after the last H2D copy out of each slot
        self.copy_stream = torch.cuda.Stream(device=DEV)
        self.count = 0

    @contextlib.contextmanager
    def next_slot(self):
        k = self.count % len(self.slots)
        self.count += 1
        yield k, self.slots[k].numpy()

    def upload(self, k, dst):
        with torch.cuda.stream(self.copy_stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # copy engine busy with earlier transfers
            dst.copy_(self.slots[k], non_blocking=True)
            self.uploaded[k] = self.copy_stream.record_event()
        return self.uploaded[k]


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    host_batches = [rng.standard_normal((ROWS, DIM), dtype=np.float32) for _ in range(N_MICRO)]
    w = torch.randn(DIM, DIM, device=DEV) / DIM ** 0.5
    reference = torch.stack([torch.relu(torch.from_numpy(h).to(DEV) @ w) for h in host_batches])

    ring = PinnedStagingRing((ROWS, DIM))
    stage = torch.cuda.Stream(device=DEV)
    dev_in = [torch.empty(ROWS, DIM, device=DEV) for _ in range(N_MICRO)]
    ring.copy_stream.wait_stream(torch.cuda.current_stream())  # dev_in blocks / earlier users
    stage.wait_stream(torch.cuda.current_stream())             # weights

    outputs = []
    for i in range(N_MICRO):
        with ring.next_slot() as (k, slot):
            np.copyto(slot, host_batches[i])  # host "tokenizer" fills the pinned slot
        arrived = ring.upload(k, dev_in[i])
        stage.wait_event(arrived)
        with torch.cuda.stream(stage):
            outputs.append(torch.relu(dev_in[i] @ w))

    torch.cuda.current_stream().wait_stream(stage)
    torch.cuda.synchronize()
    result = torch.stack(outputs)
    checksum = result.sum().item()
    ok = torch.allclose(result, reference, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={reference.sum().item():.6f} match={ok}")


if __name__ == "__main__":
    main()
