# Source: vllm/v1/worker/gpu_model_runner.py, GPUModelRunner._prepare_inputs() + synchronize_input_prep()
#   (async scheduling), with vllm/v1/utils.py CpuGpuBuffer (.cpu pinned tensor, .np = .cpu.numpy(), .gpu):
#   np.add(self.input_batch.num_computed_tokens_cpu[req_indices], arange, out=self.positions.np[:n])
#   self.positions.copy_to_gpu(n)     # gpu[:n].copy_(cpu[:n], non_blocking=True)
#   synchronize_input_prep(): prepare_inputs_event.synchronize() on entry, prepare_inputs_event.record() on exit.
# Bug: the runner prepares step k+1 while the GPU still runs step k (async scheduling), but without the
#   prepare_inputs_event guard. The host writes the numpy view self.positions.np (pinned memory) with np.add(out=)
#   while the non_blocking H2D copy of step k, queued on the default stream behind step k-1's forward, has not yet
#   read it: host write vs default-stream read of the pinned positions buffer, no happens-before edge.
# Fix: wrap input preparation in synchronize_input_prep(): prepare_inputs_event.synchronize() before the host
#   touches the pinned buffers, prepare_inputs_event.record() after the H2D copies are enqueued.
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn as nn

MAX_TOKENS, MAX_REQS, HIDDEN, MAX_POS = 64, 4, 128, 256


class CpuGpuBuffer:
    def __init__(self, *size, dtype, device, pin_memory=True):
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=pin_memory)
        self.gpu = torch.zeros_like(self.cpu, device=device)
        self.np = self.cpu.numpy()

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class PositionOnlyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos_embed = nn.Embedding(MAX_POS, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, simulate_big_model=True):
        if simulate_big_model:
            torch.cuda._sleep(30_000_000)  # the decoder layers of step k keep the GPU busy
        return self.proj(self.pos_embed(positions)).float()


class GPUModelRunner:
    def __init__(self, device):
        self.device = device
        self.model = PositionOnlyModel().to(device).eval()
        self.positions = CpuGpuBuffer(MAX_TOKENS, dtype=torch.int64, device=device)
        self.arange_np = np.arange(MAX_TOKENS, dtype=np.int64)
        self.num_computed_tokens_cpu = np.zeros(MAX_REQS, dtype=np.int64)
        self.prepare_inputs_event = torch.cuda.Event()

    @contextmanager
    def synchronize_input_prep(self):
        yield

    def _prepare_inputs(self, num_scheduled_tokens):
        num_reqs = len(num_scheduled_tokens)
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        cu_num_tokens = np.cumsum(num_scheduled_tokens)
        total = int(cu_num_tokens[-1])
        arange = self.arange_np[:total] - np.repeat(cu_num_tokens - num_scheduled_tokens, num_scheduled_tokens)
        positions_np = self.positions.np[:total]
        np.add(self.num_computed_tokens_cpu[req_indices], arange, out=positions_np)
        self.positions.copy_to_gpu(total)
        return total, positions_np.copy()  # the copy is only kept for the final check

    @torch.inference_mode()
    def execute_model(self, num_scheduled_tokens):
        with self.synchronize_input_prep():
            total, host_positions = self._prepare_inputs(num_scheduled_tokens)
        hidden = self.model(self.positions.gpu[:total])
        self.num_computed_tokens_cpu[: len(num_scheduled_tokens)] += num_scheduled_tokens
        return hidden, host_positions


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    runner = GPUModelRunner(device)
    # step 0 is a prefill of 4 prompts, then decode steps with a spec-decode burst in the middle
    schedule = [np.array([9, 5, 13, 7])] + [np.array([1, 1, 1, 1])] * 3 + [np.array([3, 3, 3, 3])] + [np.array([1, 1, 1, 1])] * 3
    outputs, seen_positions = [], []
    for num_scheduled in schedule:  # async scheduling: no host wait on step k before preparing step k+1
        hidden, host_positions = runner.execute_model(num_scheduled)
        outputs.append(hidden)
        seen_positions.append(host_positions)

    torch.cuda.synchronize()
    match = True
    with torch.inference_mode():
        for hidden, pos in zip(outputs, seen_positions):
            ref = runner.model(torch.from_numpy(pos).to(device), simulate_big_model=False)
            match &= bool(torch.allclose(hidden, ref, atol=1e-5, rtol=1e-5))
    print("steps=%d last positions=%s" % (len(outputs), seen_positions[-1].tolist()))
    print("match=%s" % match)


if __name__ == "__main__":
    main()
