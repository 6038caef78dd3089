# Source: sgl-project/sglang python/sglang/srt/speculative/spec_utils.py,
#   record_stream_for_v2_verify() / record_stream_each(), called from the spec-V2 EAGLE worker
#   (eagle_worker_v2.py) around prepare_for_verify(): "Spec V2 mutates SB mid-forward
#   (prepare_for_verify rebinds batch.input_ids / out_cache_loc) ... Each rebind drops the only SB
#   Python ref to the old tensor while the verify forward kernel may still be reading its memory
#   on fwd_stream; record_stream tells the caching allocator to wait for fwd_stream".
# Bug: batch.input_ids is allocated by the scheduler on the default stream and read by the draft
#   step on fwd_stream. prepare_for_verify() rebinds batch.input_ids to the verify tokens, freeing
#   the old tensor with no record_stream(fwd_stream) (only seq_lens / req_pool_indices are
#   recorded). The scheduler's next allocation on the default stream gets the same block and writes
#   the next batch's ids into it before the lagging fwd_stream has read it (missing record_stream).
# Fix: record_stream_for_v2_verify(batch, verify_input, fwd_stream) before prepare_for_verify().
from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda:0")
BS = 1024
NUM_DRAFT = 3
HIDDEN = 64
VOCAB = 2048
MAX_POS = 4096
NUM_STEPS = 6


def record_stream_each(tensors, stream):
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


def record_stream_for_v2_verify(batch, verify_input, fwd_stream):
    candidates = [batch.seq_lens, batch.req_pool_indices, batch.input_ids]
    if verify_input is not None:
        candidates.append(verify_input.draft_token)
    record_stream_each(candidates, fwd_stream)


@dataclass
class EagleVerifyInput:
    draft_token: torch.Tensor  # [bs * (NUM_DRAFT + 1)]


class ScheduleBatch:
    def __init__(self, input_ids, seq_lens, req_pool_indices):
        self.input_ids, self.seq_lens, self.req_pool_indices = input_ids, seq_lens, req_pool_indices

    def prepare_for_verify(self, verify_input):
        self.input_ids = verify_input.draft_token


class Scheduler:
    def __init__(self, seed):
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def get_next_batch_to_run(self):
        input_ids = torch.randint(0, VOCAB, (BS,), device=DEVICE, generator=self.gen)
        seq_lens = torch.randint(16, MAX_POS - 8, (BS,), device=DEVICE, generator=self.gen)
        req_pool_indices = torch.arange(BS, device=DEVICE)
        return ScheduleBatch(input_ids, seq_lens, req_pool_indices)


class EAGLEWorkerV2:
    def __init__(self, fwd_stream):
        g = torch.Generator(device=DEVICE).manual_seed(7)
        self.embed = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.pos_embed = torch.randn(MAX_POS, HIDDEN, device=DEVICE, generator=g)
        self.draft_head = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.target_head = self.draft_head + 0.5 * torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g)
        self.fwd_stream = fwd_stream

    def draft(self, batch):
        tok, pos, drafts = batch.input_ids, batch.seq_lens, []
        for i in range(NUM_DRAFT):
            # (ids wrapped into the vocabulary, as a vocab-parallel embedding masks them: an id the race
            # corrupts must not trip a device-side assert)
            h = self.embed[tok.remainder(VOCAB)] + self.pos_embed[pos + i]
            tok = (h @ self.draft_head.T).argmax(-1)
            drafts.append(tok)
        draft_token = torch.stack([batch.input_ids] + drafts, dim=1).flatten()
        return EagleVerifyInput(draft_token=draft_token)

    def verify(self, batch, out_tokens, out_accept_lens):
        tokens = batch.input_ids.view(BS, NUM_DRAFT + 1)
        pos = batch.seq_lens[:, None] + torch.arange(NUM_DRAFT + 1, device=DEVICE)
        target = ((self.embed[tokens.remainder(VOCAB)] + self.pos_embed[pos]) @ self.target_head.T).argmax(-1)
        accept = torch.cumprod((tokens[:, 1:] == target[:, :-1]).int(), dim=1).sum(1)
        out_tokens.copy_(target)
        out_accept_lens.copy_(accept)

    def forward_batch_generation(self, batch, out_tokens, out_accept_lens, lag_cycles):
        self.fwd_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.fwd_stream):
            torch.cuda._sleep(lag_cycles)  # the previous batch's target forward is still running
            verify_input = self.draft(batch)
            record_stream_for_v2_verify(batch, verify_input, self.fwd_stream)
            batch.prepare_for_verify(verify_input)
            self.verify(batch, out_tokens, out_accept_lens)
            record_stream_each([batch.seq_lens, batch.req_pool_indices], self.fwd_stream)


def run():
    worker = EAGLEWorkerV2(torch.cuda.Stream(device=DEVICE))
    scheduler = Scheduler(seed=0)
    out_tokens = torch.zeros(NUM_STEPS, BS, NUM_DRAFT + 1, dtype=torch.int64, device=DEVICE)
    out_accept = torch.zeros(NUM_STEPS, BS, dtype=torch.int64, device=DEVICE)
    torch.cuda.synchronize()
    for step in range(NUM_STEPS):
        batch = scheduler.get_next_batch_to_run()
        worker.forward_batch_generation(batch, out_tokens[step], out_accept[step], 30_000_000)
    torch.cuda.synchronize()
    return out_tokens, out_accept


def reference():
    # Same batches and weights, everything on the default stream: no cross-stream use at all.
    worker = EAGLEWorkerV2(fwd_stream=None)
    scheduler = Scheduler(seed=0)
    out_tokens = torch.zeros(NUM_STEPS, BS, NUM_DRAFT + 1, dtype=torch.int64, device=DEVICE)
    out_accept = torch.zeros(NUM_STEPS, BS, dtype=torch.int64, device=DEVICE)
    for step in range(NUM_STEPS):
        batch = scheduler.get_next_batch_to_run()
        batch.prepare_for_verify(worker.draft(batch))
        worker.verify(batch, out_tokens[step], out_accept[step])
    torch.cuda.synchronize()
    return out_tokens, out_accept


def main():
    with torch.inference_mode():
        tokens, accept = run()
        ref_tokens, ref_accept = reference()
    print("mean accept length:", accept.float().mean().item())
    match = torch.equal(tokens, ref_tokens) and torch.equal(accept, ref_accept)
    print(f"match={match}")


if __name__ == "__main__":
    main()
