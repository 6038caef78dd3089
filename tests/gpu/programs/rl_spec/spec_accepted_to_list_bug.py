# Source: vllm-project/vllm vllm/v1/worker/gpu_model_runner.py, GPUModelRunner._to_list() (the
#   mitigation for vllm#22754: copy into the persistent pinned sampled_token_ids_pinned_cpu buffer
#   and sync on transfer_event instead of calling .tolist() on a CUDA tensor), applied to the
#   rejection sampler output (vllm/v1/sample/rejection_sampler.py, PLACEHOLDER_TOKEN_ID = -1) to get
#   each request's accepted draft tokens + bonus token and the acceptance counts on the host.
# Bug: _to_list enqueues pinned.copy_(sampled_token_ids, non_blocking=True) on the current stream,
#   which is still running the target verify forward, and returns pinned.tolist() without
#   recording/synchronizing transfer_event: the host reads the pinned buffer before the D2H DMA
#   wrote it (host-device race on sampled_token_ids_pinned_cpu), so the accepted tokens and counts
#   come from an older step.
# Fix: self.transfer_event.record(); self.transfer_event.synchronize() before pinned.tolist().
import torch

DEVICE = torch.device("cuda:0")
PLACEHOLDER_TOKEN_ID = -1
NUM_REQS = 16
NUM_SPEC_TOKENS = 4
HIDDEN = 256
VOCAB = 4096
NUM_STEPS = 6


class SpecDecodeModelRunner:
    def __init__(self):
        g = torch.Generator(device=DEVICE).manual_seed(1)
        self.target_lm_head = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        noise = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.draft_lm_head = self.target_lm_head + 0.35 * noise  # an imperfect drafter
        self.sampled_token_ids_pinned_cpu = torch.empty(
            (NUM_REQS, NUM_SPEC_TOKENS + 1), dtype=torch.int64, pin_memory=True)
        self.transfer_event = torch.cuda.Event()

    def propose(self, hidden):
        return (hidden[:, :NUM_SPEC_TOKENS] @ self.draft_lm_head.T).argmax(-1)

    def verify(self, hidden):
        torch.cuda._sleep(30_000_000)  # stand-in for the target model's decoder layers
        return (hidden @ self.target_lm_head.T).argmax(-1)

    def rejection_sample(self, draft_token_ids, target_argmax):
        # Greedy rejection sampling: keep the matching prefix of the draft plus one target token.
        match = (draft_token_ids == target_argmax[:, :NUM_SPEC_TOKENS]).int()
        num_accepted = torch.cumprod(match, dim=1).sum(dim=1)
        pos = torch.arange(NUM_SPEC_TOKENS + 1, device=DEVICE)
        keep = pos[None, :] <= num_accepted[:, None]
        return torch.where(keep, target_argmax, torch.full_like(target_argmax, PLACEHOLDER_TOKEN_ID))

    def _to_list(self, sampled_token_ids):
        # `tolist` would trigger a device-wide stream sync; an event sync is cheaper.
        pinned = self.sampled_token_ids_pinned_cpu[: sampled_token_ids.shape[0]]
        pinned.copy_(sampled_token_ids, non_blocking=True)
        return pinned.tolist()


class Request:
    def __init__(self, rid):
        self.rid = rid
        self.output_token_ids = []
        self.num_accepted = []


def main():
    runner = SpecDecodeModelRunner()
    reqs = [Request(i) for i in range(NUM_REQS)]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gpu_outputs = []
    torch.cuda.synchronize()

    for step in range(NUM_STEPS):
        hidden = torch.randn(NUM_REQS, NUM_SPEC_TOKENS + 1, HIDDEN, device=DEVICE, generator=g)
        draft_token_ids = runner.propose(hidden)
        target_argmax = runner.verify(hidden)
        sampled_token_ids = runner.rejection_sample(draft_token_ids, target_argmax)
        gpu_outputs.append(sampled_token_ids)
        valid_sampled_token_ids = runner._to_list(sampled_token_ids)
        for req, row in zip(reqs, valid_sampled_token_ids):
            toks = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
            req.output_token_ids.extend(toks)
            req.num_accepted.append(len(toks) - 1)
        mean_acc = sum(r.num_accepted[-1] for r in reqs) / NUM_REQS
        print(f"step {step}: mean accepted draft tokens = {mean_acc:.2f}")

    # Reference: blocking copies after a full device sync.
    torch.cuda.synchronize()
    ref = [[] for _ in reqs]
    for out in gpu_outputs:
        for i, row in enumerate(out.cpu().tolist()):
            ref[i].extend(t for t in row if t != PLACEHOLDER_TOKEN_ID)
    match = all(r.output_token_ids == ref[i] for i, r in enumerate(reqs))
    print(f"match={match}")


if __name__ == "__main__":
    main()
