# Source: NVIDIA/Megatron-LM megatron/core/pipeline_parallel/reusable_buffers.py
#   (ReusableOutputBufferPool: "A slot is reused only after the stream consuming its previous
#   contents records a completion event"; acquire() makes the writer's stream wait on it).
# Pattern: 1F1B-style forward hand-off between two stage streams through a fixed ring of
#   persistent receive buffers (2 slots, like DeepSpeed's num_pipe_buffers). Stage 0 writes the
#   activation of micro-batch i straight into a pool slot, stage 1 consumes it and then releases
#   the slot back to the pool for micro-batch i + 2. The caching allocator never sees these
#   reuses: the slots are allocated once and recycled by the pool itself.
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
DEV = torch.device("cuda", 0)
N_MICRO = 6
N_SLOTS = 2
ROWS, DIM = 1024, 1024


class RecvBufferPool:
    def __init__(self, n_slots, shape):
        self.slots = [torch.empty(shape, device=DEV) for _ in range(n_slots)]
        self.released = [None] * n_slots   # event recorded by the last consumer of each slot
        self.in_use = [False] * n_slots
        self.cursor = 0

    def acquire(self, writer_stream):
        idx = self.cursor % len(self.slots)
        self.cursor += 1
        assert not self.in_use[idx], "slot handed out twice"
        if self.released[idx] is not None:
            writer_stream.wait_event(self.released[idx])
        self.in_use[idx] = True
        return idx, self.slots[idx]

    def release(self, idx, consumer_stream):
        self.in_use[idx] = False


def main():
    torch.manual_seed(0)
    w0 = torch.randn(DIM, DIM, device=DEV) / DIM ** 0.5
    w1 = torch.randn(DIM, DIM, device=DEV) / DIM ** 0.5
    inputs = [torch.randn(ROWS, DIM, device=DEV) for _ in range(N_MICRO)]
    reference = torch.stack([torch.relu(torch.mm(x, w0) @ w1) for x in inputs])

    pool = RecvBufferPool(N_SLOTS, (ROWS, DIM))
    stage0 = torch.cuda.Stream(device=DEV)
    stage1 = torch.cuda.Stream(device=DEV)
    stage0.wait_stream(torch.cuda.current_stream())  # weights, inputs
    stage1.wait_stream(torch.cuda.current_stream())  # weights

    outputs = []
    for i in range(N_MICRO):
        # stage 0: forward, output written directly into the receive slot ("send")
        idx, slot = pool.acquire(stage0)
        with torch.cuda.stream(stage0):
            torch.mm(inputs[i], w0, out=slot)
            sent = stage0.record_event()
        # stage 1: "recv", then forward on the received activation
        stage1.wait_event(sent)
        with torch.cuda.stream(stage1):
            torch.cuda._sleep(SLEEP_CYCLES)
            outputs.append(torch.relu(slot @ w1))
        pool.release(idx, stage1)

    torch.cuda.current_stream().wait_stream(stage1)
    torch.cuda.synchronize()
    result = torch.stack(outputs)
    checksum = result.sum().item()
    ok = torch.allclose(result, reference, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    print(f"checksum={checksum:.6f} reference={reference.sum().item():.6f} match={ok}")


if __name__ == "__main__":
    main()
