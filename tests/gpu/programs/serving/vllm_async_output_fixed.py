# Source: vLLM v1 vllm/v1/worker/gpu/async_utils.py (class AsyncOutput).
# The real code copies the sampler outputs to pinned host memory on a separate
# copy stream and says: "NOTE(woosuk): We must retain references to the GPU
# tensors, as the copy operations are performed on a different CUDA stream than
# the one where the tensors were created."  FIXED: the SamplerOutput is kept
# alive by the AsyncOutput until get_output() has synchronized the copy event,
# so the GPU token-id tensor is only freed after the host has observed the
# completion of the D2H copy on the copy stream.
import contextlib

import torch
import torch.nn.functional as F

DEV = torch.device("cuda:0")
NUM_REQS, HIDDEN, VOCAB, NUM_STEPS = 128, 4096, 16000, 6


class SamplerOutput:
    def __init__(self, sampled_token_ids: torch.Tensor):
        self.sampled_token_ids = sampled_token_ids  # [num_reqs, 1] int64


class ModelRunnerOutput:
    def __init__(self, req_ids):
        self.req_ids = req_ids
        self.sampled_token_ids = None


@contextlib.contextmanager
def stream(to_stream, from_stream):
    """Lightweight torch.cuda.stream() as in vLLM's async_utils."""
    try:
        torch.cuda.set_stream(to_stream)
        yield
    finally:
        torch.cuda.set_stream(from_stream)


def async_copy_to_np(x: torch.Tensor):
    return x.to("cpu", non_blocking=True).numpy()


class AsyncOutput:
    def __init__(self, model_runner_output, sampler_output, main_stream, copy_stream):
        self.model_runner_output = model_runner_output
        self.sampler_output = sampler_output  # retain GPU tensors (FIX)
        self.copy_event = torch.cuda.Event(blocking=True)
        with stream(copy_stream, main_stream):
            copy_stream.wait_stream(main_stream)
            self.sampled_token_ids = async_copy_to_np(sampler_output.sampled_token_ids)
            self.copy_event.record(copy_stream)

    def get_output(self) -> ModelRunnerOutput:
        self.copy_event.synchronize()
        out = self.model_runner_output
        out.sampled_token_ids = [row[0] for row in self.sampled_token_ids.tolist()]
        return out


class TinyGPUModelRunner:
    def __init__(self):
        g = torch.Generator(device=DEV).manual_seed(0)
        self.embed = torch.randn(VOCAB, HIDDEN, device=DEV, generator=g) * 0.02
        self.w_mlp = torch.randn(HIDDEN, HIDDEN, device=DEV, generator=g) * 0.02
        self.lm_head = torch.randn(HIDDEN, VOCAB, device=DEV, generator=g) * 0.02
        # Persistent input buffer; with async scheduling the next step's input
        # ids are taken directly from the previous step's sampled ids on GPU.
        self.input_ids = torch.randint(0, VOCAB, (NUM_REQS,), device=DEV, generator=g)
        self.main_stream = torch.cuda.current_stream()
        self.copy_stream = torch.cuda.Stream()

    def sample(self, logits: torch.Tensor) -> SamplerOutput:
        logprobs = torch.log_softmax(logits, dim=-1)
        sampled = logprobs.argmax(dim=-1, keepdim=True)
        return SamplerOutput(sampled)

    def execute_model(self, req_ids) -> AsyncOutput:
        n = len(req_ids)
        h = F.embedding(self.input_ids[:n], self.embed)
        h = h + F.silu(h @ self.w_mlp)
        logits = h @ self.lm_head
        sampler_output = self.sample(logits)
        self.input_ids[:n].copy_(sampler_output.sampled_token_ids.view(-1))
        return AsyncOutput(ModelRunnerOutput(req_ids), sampler_output,
                           self.main_stream, self.copy_stream)


def main():
    runner = TinyGPUModelRunner()
    torch.cuda.synchronize()  # model loading done
    req_ids = [f"req-{i}" for i in range(NUM_REQS)]
    outputs, pending = [], None
    for _ in range(NUM_STEPS):
        # Engine core with a batch queue of depth 2 (async scheduling):
        # launch step i+1 before collecting the output of step i.
        async_out = runner.execute_model(req_ids)
        if pending is not None:
            outputs.append(pending.get_output())
        pending = async_out
    outputs.append(pending.get_output())
    torch.cuda.synchronize()
    print("steps:", len(outputs), "first tokens:", outputs[-1].sampled_token_ids[:4])


if __name__ == "__main__":
    main()
