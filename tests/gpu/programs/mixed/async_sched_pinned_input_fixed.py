# Source: vllm-project/vllm vllm/v1/worker/gpu_model_runner.py, GPUModelRunner with async scheduling:
#         _prepare_inputs() (torch.index_select(..., out=self.input_ids.cpu[:n]) then CpuGpuBuffer.copy_to_gpu),
#         prepare_inputs_event / synchronize_input_prep(), CUDA-graph replay on the persistent input buffer.
# Bug: with async scheduling the host prepares step N+1 while step N is still queued on the GPU. The input ids
#      are gathered on the host into the persistent pinned buffer input_ids.cpu and copied to input_ids.gpu with
#      a non_blocking H2D copy on the default stream. Without prepare_inputs_event.synchronize() the host
#      overwrites input_ids.cpu for step N+1 before step N's H2D copy (still behind earlier GPU work) has read
#      it: host write vs. default-stream read of the same pinned bytes.
# Fix: synchronize_input_prep() waits on prepare_inputs_event (recorded after the previous step's H2D copy)
#      before the host touches the reused pinned buffer, and records it again after the copy is enqueued.
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn as nn

SLEEP_CYCLES = 30_000_000  # ~15 ms of sampler / proposer tail work per step on the default stream
VOCAB, HIDDEN, NUM_REQS, MAX_LEN = 2048, 256, 128, 64


class CpuGpuBuffer:
    def __init__(self, n, dtype, device):
        self.cpu = torch.zeros(n, dtype=dtype, device="cpu", pin_memory=True)
        self.gpu = torch.zeros(n, dtype=dtype, device=device)

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class DecoderLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.lm_head(h).argmax(dim=-1)


class GPUModelRunner:
    def __init__(self, model, token_table):
        self.model = model
        self.device = torch.device("cuda")
        self.token_ids_cpu_tensor = token_table  # [NUM_REQS, MAX_LEN], pageable, owned by the input batch
        self.input_ids = CpuGpuBuffer(NUM_REQS, torch.int64, self.device)
        self.prepare_inputs_event = torch.cuda.Event()
        self.prepare_inputs_event.record(torch.cuda.default_stream())  # start in a completed state
        self.cudagraph = None

    @torch.no_grad()
    def capture_model(self):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.model(self.input_ids.gpu[:NUM_REQS])
        torch.cuda.current_stream().wait_stream(s)
        self.cudagraph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.cudagraph):
            self.static_sampled = self.model(self.input_ids.gpu[:NUM_REQS])
        torch.cuda.synchronize()

    @contextmanager
    def synchronize_input_prep(self):
        # Ensure the prior step's H2D copy has finished reading the reused pinned CPU buffers.
        self.prepare_inputs_event.synchronize()
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    def _prepare_inputs(self, positions):
        token_indices = positions + np.arange(NUM_REQS) * MAX_LEN
        torch.index_select(self.token_ids_cpu_tensor.flatten(), 0, torch.from_numpy(token_indices),
                           out=self.input_ids.cpu[:NUM_REQS])
        self.input_ids.copy_to_gpu(NUM_REQS)

    @torch.no_grad()
    def execute_model(self, positions):
        with self.synchronize_input_prep():
            self._prepare_inputs(positions)
        self.cudagraph.replay()
        sampled = self.static_sampled.clone()
        torch.cuda._sleep(SLEEP_CYCLES)  # rejection sampler / spec-decode proposer still running
        return sampled


def main():
    torch.manual_seed(0)
    model = DecoderLM().cuda().eval()
    token_table = torch.randint(0, VOCAB, (NUM_REQS, MAX_LEN), dtype=torch.int64)
    runner = GPUModelRunner(model, token_table)
    runner.capture_model()

    steps = 8
    schedule = [np.full(NUM_REQS, step, dtype=np.int64) for step in range(steps)]  # one decode token / req
    outputs = [runner.execute_model(pos) for pos in schedule]  # host never blocks between steps
    torch.cuda.synchronize()

    # Reference: same graph, one step at a time, host fully synchronised around every step.
    ref = []
    for step in range(steps):
        runner.input_ids.cpu[:NUM_REQS].copy_(token_table[:, step])
        runner.input_ids.copy_to_gpu(NUM_REQS)
        runner.cudagraph.replay()
        ref.append(runner.static_sampled.clone())
        torch.cuda.synchronize()
    match = all(torch.equal(o, r) for o, r in zip(outputs, ref))
    print(f"steps={steps} match={match}")


if __name__ == "__main__":
    main()
