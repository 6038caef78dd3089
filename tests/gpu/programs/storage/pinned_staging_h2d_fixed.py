# Source: vllm-project/vllm vllm/v1/utils.py CpuGpuBuffer (pinned .cpu tensor,
#   its NumPy view .np, copy_to_gpu() = gpu[:n].copy_(cpu[:n], non_blocking=True))
#   and vllm-project/vllm-ascend PR #12191 "Patch CpuGpuBuffer with
#   double-buffer rotation to fix async H2D race": under async scheduling the
#   host refills the CPU side for the next step before the previous
#   non-blocking H2D copy has executed; the fix synchronizes an event recorded
#   after the copy before the pinned buffer is reused.
# Pattern: a generator yields scheduler outputs; the host writes token ids into
# the pinned staging buffer through its NumPy view while the GPU is still busy
# with the previous step, so the queued H2D copy reads the newer ids.
import numpy as np
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
VOCAB = 32000
HIDDEN = 256
MAX_TOKENS = 1 << 16
STEPS = 8


class CpuGpuBuffer:
    def __init__(self, size, dtype, device):
        self.cpu = torch.zeros(size, dtype=dtype, device="cpu", pin_memory=True)
        self.np = self.cpu.numpy()                  # host view of the pinned storage
        self.gpu = torch.zeros(size, dtype=dtype, device=device)

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


def scheduler_outputs(num_steps, seed=0):
    rng = np.random.default_rng(seed)
    for step in range(num_steps):
        n = MAX_TOKENS - 97 * step
        yield step, rng.integers(0, VOCAB, size=n, dtype=np.int64)


class ModelRunner:
    def __init__(self, dev):
        self.dev = dev
        self.embed = torch.randn(VOCAB, HIDDEN, device=dev)
        self.proj = torch.randn(HIDDEN, 1, device=dev)
        self.input_ids = CpuGpuBuffer(MAX_TOKENS, torch.int64, dev)
        self.h2d_done = torch.cuda.Event()

    def prepare_inputs(self, token_ids):
        n = token_ids.shape[0]
        # FIX: host waits for the previous H2D from this pinned buffer before rewriting it
        self.h2d_done.synchronize()
        self.input_ids.np[:n] = token_ids          # host writes the pinned buffer
        ids = self.input_ids.copy_to_gpu(n)
        self.h2d_done.record()
        return ids

    def execute_model(self, token_ids):
        ids = self.prepare_inputs(token_ids)
        torch.cuda._sleep(SLEEP_CYCLES)           # this step's forward keeps the GPU busy
        hidden = self.embed.index_select(0, ids)
        return (hidden @ self.proj).sum()


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    runner = ModelRunner(dev)

    # reference: synchronous upload of each step's ids
    ref = []
    for _, ids_np in scheduler_outputs(STEPS):
        ids = torch.from_numpy(ids_np).to(dev)
        ref.append((runner.embed.index_select(0, ids) @ runner.proj).sum())
    reference = torch.stack(ref).double().sum().item()
    torch.cuda.synchronize()

    # async scheduling: the host runs ahead of the GPU
    outs = [runner.execute_model(ids_np) for _, ids_np in scheduler_outputs(STEPS)]
    checksum = torch.stack(outs).double().sum().item()
    torch.cuda.synchronize()
    match = abs(checksum - reference) <= 1e-3 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
