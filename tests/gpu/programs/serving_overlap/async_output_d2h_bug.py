# Source: vLLM v1 async scheduling, vllm/v1/worker/gpu_model_runner.py,
# class AsyncGPUModelRunnerOutput: the sampled token ids are copied to the host
# on async_output_copy_stream with .to("cpu", non_blocking=True) and
# _async_copy_ready_event is recorded; get_output() must call
# self._async_copy_ready_event.synchronize() before `del self._sampled_token_ids`
# and before reading self._sampled_token_ids_cpu.tolist().
#
# Race (host-device): this bug version drops that synchronize().
#  (1) read-after-write: the scheduler (host) reads the pinned output with
#      .tolist() while the D2H copy on the copy stream, which waits for the
#      still-running forward, may not have written it yet;
#  (2) the device tensor _sampled_token_ids (allocated on the default stream)
#      is released to the caching allocator while the copy stream may still be
#      reading it, so a later step's sampler on the default stream can get the
#      same block and overwrite it.
# Fix: restore the event synchronize at the top of get_output().
import torch
import torch.nn as nn

DEV = "cuda:0"
V, H, B, STEPS = 4096, 1024, 256, 16
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait standing in for a long forward


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.mlp = nn.Sequential(nn.Linear(H, H), nn.GELU(), nn.Linear(H, H))
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        return self.lm_head(self.mlp(self.embed(ids)))


class AsyncModelRunnerOutput:
    def __init__(self, sampled_token_ids, req_ids, async_output_copy_stream):
        self._req_ids = req_ids
        self._sampled_token_ids = sampled_token_ids
        self._async_copy_ready_event = torch.cuda.Event()
        # Initiate the copy on a separate stream, but do not synchronize it.
        default_stream = torch.cuda.current_stream()
        with torch.cuda.stream(async_output_copy_stream):
            async_output_copy_stream.wait_stream(default_stream)
            self._sampled_token_ids_cpu = self._sampled_token_ids.to("cpu", non_blocking=True)
            self._async_copy_ready_event.record()

    def get_output(self):
        """Return {req_id: sampled token id}. Must block until the copy is finished."""
        # BUG: missing self._async_copy_ready_event.synchronize()

        # Release the device tensor once the copy has completed
        del self._sampled_token_ids
        valid_sampled_token_ids = self._sampled_token_ids_cpu.tolist()
        return dict(zip(self._req_ids, valid_sampled_token_ids))


class ModelRunner:
    def __init__(self):
        self.model = TinyLM().to(DEV).eval()
        self.async_output_copy_stream = torch.cuda.Stream()
        # per-step sampling noise (stands in for temperature sampling)
        self.noise = torch.randn(STEPS, B, V, device=DEV)

    @torch.inference_mode()
    def execute_model(self, step, input_ids, req_ids):
        torch.cuda._sleep(SLEEP_CYCLES)  # long forward under load
        logits = self.model(input_ids)
        sampled = (logits + self.noise[step]).argmax(dim=-1)  # sampler, default stream
        return sampled, AsyncModelRunnerOutput(sampled, req_ids, self.async_output_copy_stream)


def main():
    torch.manual_seed(0)
    runner = ModelRunner()
    # warm the pinned host-memory cache, as in a long-running server (so no
    # cudaHostAlloc happens inside the loop)
    warm = [torch.empty(B, dtype=torch.long, pin_memory=True) for _ in range(STEPS + 2)]
    del warm
    req_ids = [f"req-{i}" for i in range(B)]
    outputs = {r: [] for r in req_ids}
    input_ids = torch.randint(0, V, (B,), device=DEV)
    pending = None
    for step in range(STEPS):
        # async scheduling: launch step N (its inputs are step N-1's sampled ids,
        # still on the GPU) before the host has seen step N-1's output
        sampled, out = runner.execute_model(step, input_ids, req_ids)
        input_ids = sampled
        # while step N runs, process step N-1's output on the host
        if pending is not None:
            for r, tok in pending.get_output().items():
                outputs[r].append(tok)
        pending = out
    for r, tok in pending.get_output().items():
        outputs[r].append(tok)
    torch.cuda.synchronize()
    checksum = 0
    for i, r in enumerate(req_ids):
        for j, tok in enumerate(outputs[r]):
            checksum = (checksum + (i + 1) * (j + 1) * (tok % 1000003)) % (1 << 61)
    print(f"async_output_d2h checksum: {checksum}")


if __name__ == "__main__":
    main()
