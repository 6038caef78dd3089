# Source: vllm-project/vllm vllm/v1/worker/gpu_model_runner.py -- GPUModelRunner._prepare_inputs (torch.index_select
#   into the persistent pinned buffer `self.input_ids.cpu`, then CpuGpuBuffer.copy_to_gpu with non_blocking=True),
#   AsyncGPUModelRunnerOutput (D2H of sampled ids on async_output_copy_stream + torch.cuda.Event(blocking=True)), and
#   the engine's step_with_batch_queue (vllm/v1/engine/core.py), which submits step N+1 before it waits for step N.
#   vLLM later added `prepare_inputs_event` + `synchronize_input_prep()` to protect the reused pinned buffers.
# Bug: with async scheduling the host writes the next step's token ids into the same pinned buffer
#   (runner.input_ids.cpu) while the previous step's non_blocking H2D copy from it is still queued on the default
#   stream (behind the drafter of the step before).  get_output() only waits for the sampled-ids copy event, which
#   is recorded before the drafter, so it does not cover the H2D.  Host write vs default-stream read of the pinned
#   input_ids buffer, no happens-before: host-device race; a step runs on the next step's tokens.
# Fix: synchronize_input_prep(): prepare_inputs_event.synchronize() before the host writes the pinned buffers and
#   prepare_inputs_event.record() on the default stream right after the H2D copies are enqueued.
from collections import deque
from contextlib import contextmanager

import torch
import torch.nn as nn

DRAFTER_CYCLES = 30_000_000  # EAGLE-style drafter that runs on the default stream after sampling


class CpuGpuBuffer:
    def __init__(self, size, dtype, device):
        self.cpu = torch.zeros(size, dtype=dtype, device="cpu", pin_memory=True)
        self.gpu = torch.zeros(size, dtype=dtype, device=device)

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class AsyncGPUModelRunnerOutput:
    def __init__(self, sampled_token_ids, async_output_copy_stream):
        # Keep a reference to the device tensor: it is read on another stream.
        self._sampled_token_ids = sampled_token_ids
        # Blocking (sleep) event to avoid busy-polling the CUDA driver lock.
        self.async_copy_ready_event = torch.cuda.Event(blocking=True)
        default_stream = torch.cuda.current_stream()
        torch.cuda.set_stream(async_output_copy_stream)
        try:
            async_output_copy_stream.wait_stream(default_stream)
            self.sampled_token_ids_cpu = self._sampled_token_ids.to("cpu", non_blocking=True)
            self.async_copy_ready_event.record()
        finally:
            torch.cuda.set_stream(default_stream)

    def get_output(self):
        self.async_copy_ready_event.synchronize()
        token_ids = self.sampled_token_ids_cpu.tolist()
        del self._sampled_token_ids
        return token_ids


class TinyLM(nn.Module):
    def __init__(self, vocab=8192, hidden=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.drafter = nn.Linear(hidden, hidden)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        return hidden, self.lm_head(hidden)


class GPUModelRunner:
    def __init__(self, model, token_ids_cpu, max_num_tokens, device):
        self.model = model
        self.token_ids_cpu_tensor = token_ids_cpu  # persistent batch (pageable)
        self.input_ids = CpuGpuBuffer(max_num_tokens, torch.int64, device)
        self.async_output_copy_stream = torch.cuda.Stream(device)
        self.draft_state = None

    @contextmanager
    def synchronize_input_prep(self):
        yield

    def _prepare_inputs(self, start, num_tokens):
        token_indices = torch.arange(start, start + num_tokens)
        torch.index_select(self.token_ids_cpu_tensor, 0, token_indices, out=self.input_ids.cpu[:num_tokens])
        self.input_ids.copy_to_gpu(num_tokens)

    @torch.inference_mode()
    def execute_model(self, start, num_tokens):
        with self.synchronize_input_prep():
            self._prepare_inputs(start, num_tokens)
        hidden, logits = self.model(self.input_ids.gpu[:num_tokens])
        sampled = logits.argmax(dim=-1)
        output = AsyncGPUModelRunnerOutput(sampled, self.async_output_copy_stream)
        torch.cuda._sleep(DRAFTER_CYCLES)
        self.draft_state = self.model.drafter(hidden[-1:])  # propose_draft_token_ids
        return output


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = TinyLM().to(device).eval()
    chunk, num_steps = 2048, 8
    prompt = torch.randint(0, 8192, (chunk * num_steps,))
    runner = GPUModelRunner(model, prompt, chunk, device)

    # EngineCore.step_with_batch_queue: keep up to 2 batches in flight
    batch_queue, outputs, step = deque(), [], 0
    while step < num_steps or batch_queue:
        if step < num_steps and len(batch_queue) < 2:
            batch_queue.append(runner.execute_model(step * chunk, chunk))
            step += 1
            if len(batch_queue) < 2 and step < num_steps:
                continue
        outputs.append(batch_queue.popleft().get_output())

    torch.cuda.synchronize(device)
    with torch.inference_mode():
        expected = [model(prompt[i * chunk:(i + 1) * chunk].to(device))[1].argmax(-1).tolist() for i in range(num_steps)]
    bad = [i for i in range(num_steps) if outputs[i] != expected[i]]
    print(f"steps with wrong tokens: {bad}")
    print(f"match={not bad}")


if __name__ == "__main__":
    main()
