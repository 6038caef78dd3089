# grammar_mask_event (BUG version)
# Source: sgl-project/sglang PR #14169 ("Delay vocab mask fill instead of delaying
# sampling") and PR #14214 ("Add cuda event based on waiting value"): the sampling
# kernels are launched first and wait on a torch.cuda.Event that is recorded later,
# after the grammar bitmask has been filled; the PR notes that "torch.cuda.Event
# will not wait for an uninitialized event". Reduced to a constrained-decoding loop.
# Semantics: a torch.cuda.Event is created lazily on its first record(); wait()
# before any record() is a no-op, so the wait orders nothing.
import torch

torch.manual_seed(0)
DEV = torch.device("cuda:0")
VOCAB, HIDDEN, BS, NSTATES, STEPS = 8192, 512, 16, 8, 6


class GrammarBackend:
    """Fills the per-request vocab bitmask on its own stream (xgrammar stand-in)."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        # allowed-token table per grammar state, built on the main stream
        self.allowed = torch.rand(NSTATES, VOCAB, device=DEV) > 0.3
        self.allowed[:, 0] = True                     # every state allows token 0
        self.stream.wait_stream(torch.cuda.current_stream())

    def fill_mask(self, states, mask_buf, mask_ready):
        with torch.cuda.stream(self.stream):
            for i, s in enumerate(states):
                mask_buf[i].copy_(self.allowed[s])    # grammar stream writes the mask
            mask_ready.record()                       # records on self.stream


class Sampler:
    def sample(self, logits, mask_buf, mask_ready):
        torch.cuda.current_stream().wait_event(mask_ready)
        masked = logits.masked_fill(~mask_buf, float("-inf"))  # reads the mask
        return torch.argmax(masked, dim=-1)


def main():
    w = torch.randn(HIDDEN, VOCAB, device=DEV) / HIDDEN ** 0.5
    hidden = torch.randn(BS, HIDDEN, device=DEV)
    mask_buf = torch.zeros(BS, VOCAB, dtype=torch.bool, device=DEV)
    grammar, sampler = GrammarBackend(), Sampler()
    states = [i % NSTATES for i in range(BS)]
    out = []
    for step in range(STEPS):
        logits = hidden @ w                           # "forward" on the main stream
        mask_ready = torch.cuda.Event()               # fresh event per batch
        # BUG: sampling is launched (and its wait issued) before the mask fill is
        # enqueued and mask_ready recorded -> the wait is a no-op.
        next_tok = sampler.sample(logits, mask_buf, mask_ready)
        grammar.fill_mask(states, mask_buf, mask_ready)
        toks = next_tok.tolist()                      # syncs the main stream only
        out.append(toks)
        states = [(s * 31 + t) % NSTATES for s, t in zip(states, toks)]
        hidden = torch.tanh(hidden + 0.01 * step)
    torch.cuda.synchronize()
    print("decoded", len(out), "steps; last", out[-1][:4])


if __name__ == "__main__":
    main()
