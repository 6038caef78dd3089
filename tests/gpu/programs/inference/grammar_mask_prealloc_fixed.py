# Source: plausible pattern modelled on sgl-project/sglang python/sglang/srt/sampling/sampling_batch_info.py
#   (update_regex_vocab_mask: the grammar backend's allocate_vocab_mask(device=...), host-side
#   fill_vocab_mask, a non_blocking move to the GPU, then apply_logits_bias on the logits), with a
#   native grammar engine that owns its CUDA stream and exports the raw handle (torch.cuda.ExternalStream).
#   The allocator rule it breaks is the one behind Tensor.record_stream (pytorch/pytorch#23729):
#   a block belongs only to the stream that allocated it, so a fresh tensor handed to another
#   stream is only safe after that stream waits for the allocating stream.
# Race (bug): the grammar stream's H2D write into vocab_mask, whose block the default stream has
#   just freed from `scores` (logits.float()), vs the default stream's still-queued .float() write
#   and log_softmax read of `scores`.
import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms: the decoder forward that precedes sampling
BATCH = 128
HIDDEN = 256
VOCAB = 32768  # BATCH * VOCAB * 4 bytes = 16 MiB: one exact-size allocator segment per tensor
STEPS = 4


class GrammarBackend:
    """Stand-in for a native grammar engine that owns a CUDA stream and hands out its handle."""

    def __init__(self):
        self._native_stream = torch.cuda.Stream()

    def stream_handle(self) -> int:
        return self._native_stream.cuda_stream


class GrammarMaskApplier:
    def __init__(self, backend, host_masks, device):
        self.stream = torch.cuda.ExternalStream(backend.stream_handle())
        self.host_masks = host_masks  # pinned, filled by the grammar engine on the host
        self.device = device
        self.ready = torch.cuda.Event()

    def build(self, step):
        vocab_mask = torch.empty(BATCH, VOCAB, device=self.device)  # allocated on the current stream
        # FIX: the block may still be in use by queued work of the allocating stream; order after it.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            vocab_mask.copy_(self.host_masks[step % len(self.host_masks)], non_blocking=True)
            self.ready.record()
        torch.cuda.current_stream().wait_event(self.ready)
        return vocab_mask


class Sampler:
    def __init__(self, lm_head, grammar):
        self.lm_head = lm_head
        self.grammar = grammar

    def __call__(self, hidden, step):
        torch.cuda._sleep(SLEEP_CYCLES)
        logits = hidden @ self.lm_head  # bf16
        scores = logits.float()
        logprobs = torch.log_softmax(scores, dim=-1)  # raw logprobs returned to the client
        del scores
        vocab_mask = self.grammar.build(step)
        tokens = (logits.float() + vocab_mask).argmax(dim=-1)
        return logprobs, tokens


def main():
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(7)
    lm_head = torch.randn(HIDDEN, VOCAB, generator=g).to(device, torch.bfloat16)
    hidden = torch.randn(STEPS, BATCH, HIDDEN, generator=g).to(device, torch.bfloat16)
    host_masks = []
    for _ in range(2):
        allowed = torch.rand(BATCH, VOCAB, generator=g) < 0.05
        host_masks.append(torch.where(allowed, 0.0, -1.0e4).pin_memory())
    sampler = Sampler(lm_head, GrammarMaskApplier(GrammarBackend(), host_masks, device))
    with torch.inference_mode():
        # Reference: the same math, serial on the default stream.
        ref_lp, ref_tok = [], []
        for step in range(STEPS):
            logits = hidden[step] @ lm_head
            ref_lp.append(torch.log_softmax(logits.float(), dim=-1).sum(dim=-1))
            mask = host_masks[step % 2].to(device)
            ref_tok.append((logits.float() + mask).argmax(dim=-1))
        ref_lp, ref_tok = torch.stack(ref_lp).cpu(), torch.stack(ref_tok).cpu()
        del logits, mask
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out_lp, out_tok = [], []
        for step in range(STEPS):
            logprobs, tokens = sampler(hidden[step], step)
            out_lp.append(logprobs.sum(dim=-1))
            out_tok.append(tokens)
        out_lp, out_tok = torch.stack(out_lp).cpu(), torch.stack(out_tok).cpu()
    torch.cuda.synchronize()
    match = torch.equal(out_tok, ref_tok) and torch.allclose(out_lp, ref_lp, rtol=1e-5, atol=1e-2)
    checksum = float(out_lp.double().sum()) + float(out_tok.double().sum())
    reference = float(ref_lp.double().sum()) + float(ref_tok.double().sum())
    print(f"checksum={checksum:.3f} reference={reference:.3f} match={match}")


if __name__ == "__main__":
    main()
