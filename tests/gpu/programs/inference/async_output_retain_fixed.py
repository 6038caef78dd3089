# Source: vllm-project/vllm vllm/v1/worker/gpu/async_utils.py -- AsyncOutput.__init__:
#   "NOTE(woosuk): We must retain references to the GPU tensors, as the copy operations are
#   performed on a different CUDA stream than the one where the tensors were created."
#   The D2H copies run on copy_stream (entered with the lightweight stream() context manager
#   built on torch.cuda.set_stream), copy_event is recorded, and get_output() synchronizes it.
# Race (bug): sampled_token_ids is allocated on the main (default) stream, read by the D2H copy
#   on copy_stream and freed without record_stream or a sync; the next step's allocations on the
#   main stream reuse the block and overwrite it before the queued copy reads it.
import contextlib

import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms backlog on copy_stream
BATCH = 512
HIDDEN = 256
VOCAB = 2048
STEPS = 6


@contextlib.contextmanager
def stream(to_stream, from_stream):
    try:
        torch.cuda.set_stream(to_stream)
        yield
    finally:
        torch.cuda.set_stream(from_stream)


class SamplerOutput:
    def __init__(self, sampled_token_ids):
        self.sampled_token_ids = sampled_token_ids


class AsyncOutput:
    def __init__(self, sampler_output, main_stream, copy_stream):
        # FIX: retain the GPU tensors until get_output() has synchronized the copy on copy_stream.
        self.sampler_output = sampler_output
        self.copy_event = torch.cuda.Event()
        with stream(copy_stream, main_stream):
            copy_stream.wait_stream(main_stream)
            torch.cuda._sleep(SLEEP_CYCLES)
            self.sampled_token_ids = sampler_output.sampled_token_ids.to("cpu", non_blocking=True)
            self.copy_event.record(copy_stream)

    def get_output(self):
        self.copy_event.synchronize()
        return self.sampled_token_ids.tolist()


class ModelRunner:
    def __init__(self, device, inputs, lm_head):
        self.inputs = inputs
        self.lm_head = lm_head
        self.main_stream = torch.cuda.current_stream()
        self.copy_stream = torch.cuda.Stream()

    def sample(self, step):
        logits = (self.inputs[step] @ self.lm_head).float()
        return SamplerOutput(logits.argmax(dim=-1))

    def execute_model(self, step):
        sampler_output = self.sample(step)
        return AsyncOutput(sampler_output, self.main_stream, self.copy_stream)


def generate(runner):
    """Async scheduling: launch step N, then hand out the tokens of step N-1."""
    prev = None
    for step in range(STEPS):
        output = runner.execute_model(step)
        if prev is not None:
            yield prev.get_output()
        prev = output
    yield prev.get_output()


def main():
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(6)
    inputs = torch.randn(STEPS, BATCH, HIDDEN, generator=g).to(device)
    lm_head = torch.randn(HIDDEN, VOCAB, generator=g).to(device)
    runner = ModelRunner(device, inputs, lm_head)
    with torch.inference_mode():
        # Reference: the same sampling kernels, run serially before any stream overlap.
        reference = torch.stack([runner.sample(s).sampled_token_ids for s in range(STEPS)]).cpu().tolist()
        torch.cuda.synchronize()
        tokens = [toks for toks in generate(runner)]
    torch.cuda.synchronize()
    checksum = sum((i + 1) * t for i, t in enumerate(t for toks in tokens for t in toks))
    ref_sum = sum((i + 1) * t for i, t in enumerate(t for toks in reference for t in toks))
    print(f"checksum={checksum} reference={ref_sum} match={tokens == reference}")


if __name__ == "__main__":
    main()
