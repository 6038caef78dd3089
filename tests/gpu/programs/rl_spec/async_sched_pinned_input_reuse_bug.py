# Source: vllm-project/vllm vllm/v1/worker/gpu_model_runner.py, GPUModelRunner.execute_model() /
#   synchronize_input_prep() with prepare_inputs_event (PR #24527, PR #25279 "Fix async scheduling
#   CPU tensor race take 2", PR #29288 "Fix eagle async scheduling cpu race", PR #34866), and the
#   CpuGpuBuffer pinned staging buffers (vllm/v1/utils.py) used by _prepare_inputs.
# Bug: with async scheduling the host prepares step N+1 while step N is still queued on the GPU.
#   _prepare_inputs gathers the next input ids (last sampled token + draft tokens of every request)
#   into the reused pinned buffer input_ids.cpu with torch.index_select(..., out=) and enqueues
#   input_ids.gpu.copy_(input_ids.cpu, non_blocking=True). Nothing orders that host write after
#   the previous step's H2D DMA from the same pinned buffer, which still waits behind the previous
#   forward on the stream (host-device race on input_ids.cpu): a step runs on the next step's tokens.
# Fix: prepare_inputs_event.synchronize() before touching the pinned buffers and
#   prepare_inputs_event.record() after enqueuing the H2D copies.
from contextlib import contextmanager

import numpy as np
import torch

DEVICE = torch.device("cuda:0")
NUM_REQS = 32
NUM_SPEC_TOKENS = 3
MAX_MODEL_LEN = 256
VOCAB = 8192
HIDDEN = 256
NUM_STEPS = 8


class CpuGpuBuffer:
    def __init__(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=True)
        self.gpu = torch.zeros(size, dtype=dtype, device=DEVICE)

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class GPUModelRunner:
    def __init__(self):
        g = torch.Generator(device=DEVICE).manual_seed(0)
        self.embed_tokens = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.lm_head = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        max_tokens = NUM_REQS * (NUM_SPEC_TOKENS + 1)
        self.input_ids = CpuGpuBuffer(max_tokens, torch.int64)
        # Persistent per-request token table (pageable, like InputBatch.token_ids_cpu_tensor).
        self.token_ids_cpu_tensor = torch.zeros((NUM_REQS, MAX_MODEL_LEN), dtype=torch.int64)
        self.num_computed_tokens = np.zeros(NUM_REQS, dtype=np.int64)
        self.prepare_inputs_event = torch.cuda.Event()
        self.sampled = torch.zeros((NUM_STEPS, max_tokens), dtype=torch.int64, device=DEVICE)

    @contextmanager
    def synchronize_input_prep(self):
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    def _update_states(self, scheduled_token_ids):
        for i, toks in enumerate(scheduled_token_ids):
            start = self.num_computed_tokens[i]
            self.token_ids_cpu_tensor[i, start:start + len(toks)] = torch.tensor(toks)

    def _prepare_inputs(self, scheduled_token_ids):
        n_per_req = NUM_SPEC_TOKENS + 1
        req_indices = np.repeat(np.arange(NUM_REQS), n_per_req)
        positions = self.num_computed_tokens[req_indices] + np.tile(np.arange(n_per_req), NUM_REQS)
        token_indices = torch.from_numpy(req_indices * MAX_MODEL_LEN + positions)
        total = token_indices.numel()
        torch.index_select(self.token_ids_cpu_tensor.flatten(), 0, token_indices,
                           out=self.input_ids.cpu[:total])
        self.input_ids.copy_to_gpu(total)
        self.num_computed_tokens += n_per_req
        return total

    def _model_forward(self, step, num_tokens):
        torch.cuda._sleep(30_000_000)  # stand-in for the decoder layers
        hidden = self.embed_tokens[self.input_ids.gpu[:num_tokens]]
        self.sampled[step, :num_tokens] = (hidden @ self.lm_head.T).argmax(-1)

    def execute_model(self, step, scheduled_token_ids):
        with self.synchronize_input_prep():
            self._update_states(scheduled_token_ids)
            num_tokens = self._prepare_inputs(scheduled_token_ids)
        self._model_forward(step, num_tokens)


def main():
    runner = GPUModelRunner()
    rng = np.random.default_rng(0)
    torch.cuda.synchronize()
    schedule = []
    for step in range(NUM_STEPS):
        # Scheduler output: per request the last sampled token followed by its draft tokens.
        scheduled = rng.integers(0, VOCAB, size=(NUM_REQS, NUM_SPEC_TOKENS + 1)).tolist()
        schedule.append(scheduled)
        runner.execute_model(step, scheduled)  # async scheduling: no sync per step

    torch.cuda.synchronize()
    ok_steps = []
    for step, scheduled in enumerate(schedule):
        ids = torch.tensor(scheduled, dtype=torch.int64, device=DEVICE).flatten()
        ref = (runner.embed_tokens[ids] @ runner.lm_head.T).argmax(-1)
        ok_steps.append(bool(torch.equal(ref, runner.sampled[step, :ids.numel()])))
    print("per-step match:", ok_steps)
    print(f"match={all(ok_steps)}")


if __name__ == "__main__":
    main()
