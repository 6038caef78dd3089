# Source: vllm-project/vllm vllm/v1/worker/gpu_model_runner.py -- GPUModelRunner.synchronize_input_prep()
#   and prepare_inputs_event. With async scheduling the runner refills its persistent pinned
#   CPU staging buffers (input_ids_cpu, via a NumPy view) for step N+1 while the non_blocking
#   H2D copy of step N out of the same buffer may still sit in the stream queue behind the
#   previous forward. vLLM synchronizes prepare_inputs_event before touching the buffers.
# Race (bug): the host's NumPy write into input_ids_cpu for step N+1 vs the pending H2D copy
#   of step N that still reads input_ids_cpu.
import contextlib

import numpy as np
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms: stands in for the transformer layers of one step
MAX_TOKENS = 2048
VOCAB = 1024
HIDDEN = 256
STEPS = 6


class ModelRunner:
    def __init__(self, device):
        self.device = device
        # Persistent staging buffers, as vLLM's CpuGpuBuffer: pinned CPU + GPU twin.
        self.input_ids_cpu = torch.zeros(MAX_TOKENS, dtype=torch.int64, pin_memory=True)
        self.input_ids_np = self.input_ids_cpu.numpy()
        self.input_ids_gpu = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
        g = torch.Generator().manual_seed(0)
        # Small integer weights keep every float32 sum exact.
        self.embed_cpu = torch.randint(-8, 8, (VOCAB, HIDDEN), generator=g).float()
        self.embed = self.embed_cpu.to(device)
        self.prepare_inputs_event = torch.cuda.Event()
        self.step_sums = []

    @contextlib.contextmanager
    def synchronize_input_prep(self):
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    def execute_model(self, token_ids: np.ndarray):
        n = token_ids.shape[0]
        with self.synchronize_input_prep():
            self.input_ids_np[:n] = token_ids  # host write into the pinned staging buffer
            self.input_ids_gpu[:n].copy_(self.input_ids_cpu[:n], non_blocking=True)
        ids = self.input_ids_gpu[:n]
        hidden = self.embed[ids].reshape(n, HIDDEN).contiguous()
        torch.cuda._sleep(SLEEP_CYCLES)  # rest of the forward pass
        self.step_sums.append(hidden.float().flatten().sum())


def make_tokens(step):
    return (np.arange(MAX_TOKENS, dtype=np.int64) * (2 * step + 3) + 11 * step) % VOCAB


def main():
    device = torch.device("cuda", 0)
    runner = ModelRunner(device)
    torch.cuda.synchronize()
    with torch.inference_mode():
        for step in range(STEPS):
            runner.execute_model(make_tokens(step))
        sums = torch.stack(runner.step_sums).cpu()
    torch.cuda.synchronize()
    checksum = float(sums.double().sum())
    reference = sum(float(runner.embed_cpu[torch.from_numpy(make_tokens(s))].sum()) for s in range(STEPS))
    print(f"checksum={checksum:.1f} reference={reference:.1f} match={checksum == reference}")


if __name__ == "__main__":
    main()
