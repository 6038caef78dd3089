# Source: vllm-project/vllm vllm/v1/worker/gpu_model_runner.py, GPUModelRunner.synchronize_input_prep():
#   under async scheduling the runner refills its reused pinned CPU staging buffers (CpuGpuBuffer .np views)
#   for step N+1 while step N's non_blocking H2D copy may still be queued; upstream guards the refill with
#   prepare_inputs_event.synchronize() on entry and prepare_inputs_event.record() on exit.
from contextlib import contextmanager

import numpy as np
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms: the previous step's forward still occupies the stream
DEVICE = torch.device("cuda", 0)
VOCAB = 32000
HIDDEN = 256
NUM_TOKENS = 8192
NUM_STEPS = 8


class CpuGpuBuffer:
    """Pinned host staging buffer + device twin, written by the host through a NumPy view."""

    def __init__(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=True)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=DEVICE)

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class GPUModelRunner:
    def __init__(self):
        self.input_ids = CpuGpuBuffer(NUM_TOKENS, torch.int64)
        embed = torch.randn(VOCAB, HIDDEN, device=DEVICE, dtype=torch.float64)
        self.embed_rowsum = embed.sum(dim=1)  # tiny stand-in for "the model"
        self.outputs = torch.zeros(NUM_STEPS, device=DEVICE, dtype=torch.float64)
        self.prepare_inputs_event = torch.cuda.Event()

    @contextmanager
    def synchronize_input_prep(self):
        # Ensure the previous step has finished with the reused CPU tensors.
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    def _prepare_inputs(self, token_ids):
        n = len(token_ids)
        self.input_ids.np[:n] = token_ids
        return self.input_ids.copy_to_gpu(n)

    def execute_model(self, step, token_ids):
        with self.synchronize_input_prep():
            input_ids = self._prepare_inputs(token_ids)
        # Forward pass (queued behind the previous step's forward).
        torch.cuda._sleep(SLEEP_CYCLES)
        positions = torch.arange(1, input_ids.numel() + 1, device=DEVICE, dtype=torch.float64)
        self.outputs[step] = (self.embed_rowsum[input_ids] * positions).sum()


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    runner = GPUModelRunner()
    schedule = [rng.integers(0, VOCAB, size=NUM_TOKENS, dtype=np.int64) for _ in range(NUM_STEPS)]
    torch.cuda.synchronize()

    # Async scheduling loop: no host sync between steps.
    for step, token_ids in enumerate(schedule):
        runner.execute_model(step, token_ids)

    torch.cuda.synchronize()
    rowsum = runner.embed_rowsum.cpu().numpy()
    positions = np.arange(1, NUM_TOKENS + 1, dtype=np.float64)
    reference = float(sum((rowsum[ids] * positions).sum() for ids in schedule))
    checksum = float(runner.outputs.sum().item())
    match = abs(checksum - reference) <= 1e-9 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
