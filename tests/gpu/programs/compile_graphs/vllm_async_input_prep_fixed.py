# Source: vllm/v1/worker/gpu_model_runner.py, GPUModelRunner.synchronize_input_prep() and _prepare_inputs()
#         (async scheduling, EngineCore.step_with_batch_queue with a batch queue of depth 2). _prepare_inputs
#         fills the pinned staging half of a CpuGpuBuffer (torch.index_select(..., out=self.input_ids.cpu[:n]))
#         and CpuGpuBuffer.copy_to_gpu() sends it to self.input_ids.gpu with non_blocking=True; the FULL CUDA
#         graph reads self.input_ids.gpu. vLLM guards the pinned buffer with self.prepare_inputs_event, which is
#         only created when use_async_scheduling is set.
# Bug: the runner was built without the event (prepare_inputs_event is None, so synchronize_input_prep() is a
#      no-op) but the engine still runs two batches ahead. Step i's H2D copy input_ids.cpu -> input_ids.gpu is
#      queued on the default stream behind step i's other GPU work; the host returns to execute_model(i+1) and
#      rewrites input_ids.cpu (index_select on the host) before that DMA has read it. Host write vs default-stream
#      read of the pinned input_ids.cpu buffer, no event/sync between them: step i runs on step i+1's tokens.
# Fix: create prepare_inputs_event, so synchronize_input_prep() does prepare_inputs_event.synchronize() before the
#      host touches the pinned buffer and prepare_inputs_event.record() after the H2D copy is enqueued.
from collections import deque
from contextlib import contextmanager

import torch

DEVICE = torch.device("cuda:0")
SLEEP_CYCLES = 30_000_000  # ~15 ms on an H200
VOCAB, HIDDEN, NUM_REQS, MAX_LEN, STEPS = 1024, 256, 32, 16, 8


class CpuGpuBuffer:
    def __init__(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=True)
        self.gpu = torch.zeros(size, dtype=dtype, device=DEVICE)

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class TinyDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + torch.tanh(self.mlp(h))
        return self.lm_head(h)


class AsyncModelRunnerOutput:
    """Mirrors vllm AsyncGPUModelRunnerOutput: D2H of sampled ids on a side copy stream."""

    def __init__(self, sampled_token_ids, copy_stream):
        self._sampled_token_ids = sampled_token_ids
        self._ready = torch.cuda.Event()
        default_stream = torch.cuda.current_stream()
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(default_stream)
            self._sampled_cpu = sampled_token_ids.to("cpu", non_blocking=True)
            self._ready.record()

    def get_output(self):
        self._ready.synchronize()
        out = self._sampled_cpu.tolist()
        del self._sampled_token_ids
        return out


class GPUModelRunner:
    def __init__(self, model, token_ids_cpu, use_async_scheduling):
        self.model = model
        self.token_ids_cpu_tensor = token_ids_cpu  # [NUM_REQS, MAX_LEN], pageable, like InputBatch
        self.input_ids = CpuGpuBuffer(NUM_REQS, torch.int64)
        self.async_output_copy_stream = torch.cuda.Stream()
        # FIX: the pinned staging buffers are reused every step, so async scheduling needs the event.
        self.prepare_inputs_event = torch.cuda.Event() if use_async_scheduling else None

    @contextmanager
    def synchronize_input_prep(self):
        if self.prepare_inputs_event is None:
            yield
            return
        # Ensure prior step has finished with reused CPU tensors.
        self.prepare_inputs_event.synchronize()
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    def _update_states(self):
        # Stand-in for the GPU-side bookkeeping a busy engine enqueues before the inputs
        # (block-table commit, previous-token scatter): keeps the default stream behind the host.
        torch.cuda._sleep(SLEEP_CYCLES)

    def _prepare_inputs(self, step):
        token_indices = torch.arange(NUM_REQS) * MAX_LEN + step
        torch.index_select(self.token_ids_cpu_tensor.flatten(), 0, token_indices,
                           out=self.input_ids.cpu[:NUM_REQS])
        self.input_ids.copy_to_gpu(NUM_REQS)

    def capture_model(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(self.input_ids.gpu[:NUM_REQS])
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_logits = self.model(self.input_ids.gpu[:NUM_REQS])
        torch.cuda.synchronize()

    def execute_model(self, step):
        with self.synchronize_input_prep():
            self._update_states()
            self._prepare_inputs(step)
        self.graph.replay()
        sampled = self.static_logits.argmax(dim=-1)
        return AsyncModelRunnerOutput(sampled, self.async_output_copy_stream)


@torch.inference_mode()
def main():
    torch.manual_seed(0)
    model = TinyDecoder().to(DEVICE).eval()
    token_ids_cpu = torch.randint(0, VOCAB, (NUM_REQS, MAX_LEN), dtype=torch.int64)
    runner = GPUModelRunner(model, token_ids_cpu, use_async_scheduling=True)
    runner.capture_model()

    batch_queue, outputs = deque(), []
    for step in range(STEPS):  # EngineCore.step_with_batch_queue, max_concurrent_batches=2
        batch_queue.appendleft(runner.execute_model(step))
        if len(batch_queue) == 2:
            outputs.append(batch_queue.pop().get_output())
    while batch_queue:
        outputs.append(batch_queue.pop().get_output())

    torch.cuda.synchronize()
    ok = True
    for step, got in enumerate(outputs):
        ref = model(token_ids_cpu[:, step].to(DEVICE)).argmax(dim=-1).tolist()
        ok &= ref == got
    print(f"steps={len(outputs)} match={ok}")


if __name__ == "__main__":
    main()
