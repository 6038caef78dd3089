# Source: vllm-project/vllm vllm/v1/worker/gpu/async_utils.py, AsyncOutput.__init__ / get_output
#   ("NOTE(woosuk): We must retain references to the GPU tensors, as the copy operations are
#   performed on a different CUDA stream than the one where the tensors were created."), used by
#   the V2 model runner with spec decoding (sampled_token_ids with -1 for rejected drafts and
#   num_sampled_tokens per request).
# Bug: AsyncOutput keeps only the pinned numpy results. sampled_token_ids / num_sampled_tokens are
#   allocated on the main stream, read by the non_blocking D2H copies on copy_stream, and the
#   model runner drops its last reference when execute_model() returns, with no record_stream
#   (copy_stream). The caching allocator gives those blocks to the next step's allocations on the
#   main stream, which overwrite them before the lagging copy stream reads them
#   (missing record_stream -> host gets the next step's intermediates as tokens).
# Fix: AsyncOutput retains the GPU tensors until get_output() has seen copy_event complete.
import contextlib
import time

import torch

DEVICE = torch.device("cuda:0")
NUM_REQS = 24
NUM_SPEC_TOKENS = 3
HIDDEN = 256
VOCAB = 4096
NUM_STEPS = 6


@contextlib.contextmanager
def stream(to_stream, from_stream):
    try:
        torch.cuda.set_stream(to_stream)
        yield
    finally:
        torch.cuda.set_stream(from_stream)


def async_copy_to_np(x):
    return x.to("cpu", non_blocking=True).numpy()


class AsyncOutput:
    def __init__(self, sampled_token_ids, num_sampled_tokens, main_stream, copy_stream):
        self.copy_event = torch.cuda.Event()
        with stream(copy_stream, main_stream):
            copy_stream.wait_stream(main_stream)
            # The copy stream is still draining earlier D2H traffic (prompt logprobs, KV offload).
            torch.cuda._sleep(25_000_000)
            self.sampled_token_ids_np = async_copy_to_np(sampled_token_ids)
            self.num_sampled_tokens_np = async_copy_to_np(num_sampled_tokens)
            self.copy_event.record(copy_stream)

    def get_output(self):
        while not self.copy_event.query():  # poll instead of blocking the driver
            time.sleep(0.0002)
        sampled = self.sampled_token_ids_np.tolist()
        for token_ids, n in zip(sampled, self.num_sampled_tokens_np.tolist()):
            del token_ids[n:]
        return sampled


class ModelRunner:
    def __init__(self):
        g = torch.Generator(device=DEVICE).manual_seed(3)
        self.lm_head = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.draft_head = self.lm_head + 0.3 * torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.main_stream = torch.cuda.current_stream()
        self.copy_stream = torch.cuda.Stream(device=DEVICE)

    def sample(self, hidden):
        target = (hidden @ self.lm_head.T).argmax(-1)  # [reqs, K+1]
        draft = (hidden[:, :NUM_SPEC_TOKENS] @ self.draft_head.T).argmax(-1)
        num_accepted = torch.cumprod((draft == target[:, :NUM_SPEC_TOKENS]).int(), 1).sum(1)
        num_sampled_tokens = num_accepted + 1
        pos = torch.arange(NUM_SPEC_TOKENS + 1, device=DEVICE)
        sampled_token_ids = torch.where(pos[None, :] < num_sampled_tokens[:, None], target, -1)
        return sampled_token_ids, num_sampled_tokens

    def execute_model(self, hidden):
        sampled_token_ids, num_sampled_tokens = self.sample(hidden)
        return AsyncOutput(sampled_token_ids, num_sampled_tokens, self.main_stream, self.copy_stream)


def main():
    runner = ModelRunner()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    hiddens = [torch.randn(NUM_REQS, NUM_SPEC_TOKENS + 1, HIDDEN, device=DEVICE, generator=g)
               for _ in range(NUM_STEPS)]
    torch.cuda.synchronize()

    outputs, prev = [], None
    for step in range(NUM_STEPS):
        cur = runner.execute_model(hiddens[step])
        if prev is not None:  # async scheduling: consume step N-1 after launching step N
            outputs.append(prev.get_output())
        prev = cur
    outputs.append(prev.get_output())
    prev = None

    torch.cuda.synchronize()
    match = True
    for step, got in enumerate(outputs):
        ids, nums = runner.sample(hiddens[step])
        ref = [row[:n] for row, n in zip(ids.cpu().tolist(), nums.cpu().tolist())]
        if got != ref:
            match = False
            print(f"step {step}: host tokens differ from the sampler output")
    print(f"match={match}")


if __name__ == "__main__":
    main()
