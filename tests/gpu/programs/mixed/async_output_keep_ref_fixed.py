# Source: vllm-project/vllm vllm/v1/worker/gpu_model_runner.py, class AsyncGPUModelRunnerOutput.__init__ /
#         get_output() ("Keep a reference to the device tensor to avoid it being deallocated until we finish
#         copying it to the host"), used by GPUModelRunner.execute_model() with async scheduling.
# Bug: the sampled token ids are produced on the default stream; AsyncGPUModelRunnerOutput starts their D2H copy
#      on async_output_copy_stream (after wait_stream(default)) but does not keep a reference to the device tensor.
#      execute_model() returns, the tensor's last reference dies and its block goes back to the default stream's
#      pool with no record of the copy stream's pending read; the next step's allocations on the default stream
#      reuse the block and overwrite it before the copy stream has read it.
# Fix: store self._sampled_token_ids = sampled_token_ids in the output object, so the block is not freed until
#      get_output() has synchronized _async_copy_ready_event (the copy finished) and the object is dropped.
import torch
from transformers import LlamaConfig, LlamaForCausalLM

SLEEP_CYCLES = 30_000_000  # ~15 ms: the copy stream is queued behind other D2H traffic
NUM_REQS, SEQ = 256, 4


class AsyncGPUModelRunnerOutput:
    def __init__(self, req_ids, sampled_token_ids, async_output_copy_stream):
        self._req_ids = req_ids
        # Event on the copy stream so we can synchronize the non-blocking copy.
        self._async_copy_ready_event = torch.cuda.Event()
        # Keep a reference to the device tensor to avoid it being
        # deallocated until we finish copying it to the host.
        self._sampled_token_ids = sampled_token_ids
        # Initiate the copy on a separate stream, but do not synchronize it.
        default_stream = torch.cuda.current_stream()
        with torch.cuda.stream(async_output_copy_stream):
            async_output_copy_stream.wait_stream(default_stream)
            torch.cuda._sleep(SLEEP_CYCLES)
            self._sampled_token_ids_cpu = self._sampled_token_ids.to("cpu", non_blocking=True)
            self._async_copy_ready_event.record()

    def get_output(self):
        """Blocks until the copy is finished, then builds the host-side output."""
        self._async_copy_ready_event.synchronize()
        valid_sampled_token_ids = self._sampled_token_ids_cpu.flatten().tolist()
        return dict(zip(self._req_ids, valid_sampled_token_ids))


class GPUModelRunner:
    def __init__(self, model):
        self.model = model
        self.async_output_copy_stream = torch.cuda.Stream()

    @torch.inference_mode()
    def execute_model(self, req_ids, token_ids):
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device="cuda")
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1, :]
        sampled_token_ids = logits.argmax(dim=-1, keepdim=True)
        return AsyncGPUModelRunnerOutput(req_ids, sampled_token_ids, self.async_output_copy_stream)


def main():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to("cuda").eval()
    runner = GPUModelRunner(model)
    steps = 5
    batches = [torch.randint(0, cfg.vocab_size, (NUM_REQS, SEQ)).tolist() for _ in range(steps)]
    req_ids = [f"req-{i}" for i in range(NUM_REQS)]
    torch.cuda.synchronize()

    # EngineCore.step_with_batch_queue: schedule step N+1 before collecting the output of step N.
    outputs, pending = [], None
    for step in range(steps):
        out = runner.execute_model(req_ids, batches[step])
        if pending is not None:
            outputs.append(pending.get_output())
        pending = out
    outputs.append(pending.get_output())
    pending = out = None
    torch.cuda.synchronize()

    with torch.inference_mode():
        ref = []
        for toks in batches:
            ids = torch.tensor(toks, dtype=torch.int64, device="cuda")
            sampled = model(input_ids=ids, use_cache=False).logits[:, -1, :].argmax(dim=-1)
            ref.append(dict(zip(req_ids, sampled.cpu().tolist())))
    print(f"steps={steps} match={outputs == ref}")


if __name__ == "__main__":
    main()
