# Source: vllm-project/vllm vllm/v1/worker/gpu_model_runner.py, AsyncGPUModelRunnerOutput: the sampled
#   token ids are copied to the host with .to("cpu", non_blocking=True) on async_output_copy_stream and
#   get_output() calls async_copy_ready_event.synchronize() before .tolist(). Bug (plausible variant):
#   get_output() synchronizes the compute stream that produced the ids instead of the copy event, so the
#   D2H copy queued on the copy stream is not waited for.
import torch
import torch.nn as nn

SLEEP_CYCLES = 20_000_000  # ~10 ms: the copy stream is still draining earlier transfers (e.g. logprobs)
DEVICE = torch.device("cuda", 0)
VOCAB = 4096
HIDDEN = 512
BATCH = 64
NUM_STEPS = 6


class AsyncGPUModelRunnerOutput:
    def __init__(self, sampled_token_ids, async_output_copy_stream):
        # Keep a reference to the device tensor: it is read on another stream.
        self._sampled_token_ids = sampled_token_ids
        self._compute_stream = torch.cuda.current_stream()
        # Blocking event: synchronize() sleeps instead of spinning.
        self.async_copy_ready_event = torch.cuda.Event(blocking=True)
        with torch.cuda.stream(async_output_copy_stream):
            async_output_copy_stream.wait_stream(self._compute_stream)
            torch.cuda._sleep(SLEEP_CYCLES)
            self.sampled_token_ids_cpu = self._sampled_token_ids.to("cpu", non_blocking=True)
            self.async_copy_ready_event.record()

    def get_output(self):
        """Blocks until the copy is finished, then returns the host token ids."""
        self._compute_stream.synchronize()
        return self.sampled_token_ids_cpu.tolist()


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.proj(self.embed(ids))))


class GPUModelRunner:
    def __init__(self, model):
        self.model = model
        self.async_output_copy_stream = torch.cuda.Stream()

    @torch.inference_mode()
    def execute_model(self, prev_sampled_token_ids):
        logits = self.model(prev_sampled_token_ids)
        sampled = logits.argmax(dim=-1)
        return sampled, AsyncGPUModelRunnerOutput(sampled, self.async_output_copy_stream)


def main():
    torch.manual_seed(0)
    model = TinyLM().to(DEVICE).eval()
    runner = GPUModelRunner(model)
    ids = torch.randint(0, VOCAB, (BATCH,), device=DEVICE)
    torch.cuda.synchronize()

    outputs = []  # engine keeps every step's output object alive until the end
    host_tokens = []
    prev = None
    for _ in range(NUM_STEPS):
        # Async scheduling: step N+1 is launched from the GPU-side ids before step N's output is consumed.
        ids, out = runner.execute_model(ids)
        outputs.append(out)
        if prev is not None:
            host_tokens.append(prev.get_output())
        prev = out
    host_tokens.append(prev.get_output())

    torch.cuda.synchronize()
    reference = [o._sampled_token_ids.tolist() for o in outputs]
    checksum = sum(sum(t) for t in host_tokens)
    ref_sum = sum(sum(t) for t in reference)
    match = host_tokens == reference
    print(f"checksum={checksum} reference={ref_sum} match={match}")


if __name__ == "__main__":
    main()
