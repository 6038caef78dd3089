"""Speculative decoding loop: a small draft model proposes K tokens on a side
stream, the target model verifies them on the main stream, and acceptance is
computed entirely on the GPU (no host sync per round), so the host can run
ahead and queue the next round's draft while verification is still running.

Modeled on: sgl-project/sglang PR #22113 (EAGLE v2: a second stream read
draft tensors written on the main stream; fix = record an event on main after
the writes and wait on it before the reads) and huggingface/trl PR #7195 (work
enqueued after the wait_stream() snapshot is not covered by it).

BUG: `draft_stream.wait_stream(main)` is issued at the END of the draft block,
i.e. before this round's verify() is enqueued.  The next round's draft is
therefore ordered after the verify of the round before, one round too late:
it reads `last_token` and overwrites `draft_tokens` while verify() may still
be writing / reading them.
"""
import torch

DEV = torch.device("cuda:0")
VOCAB = 512
HID = 256
BATCH = 16
K = 4  # draft length
ROUNDS = 6


class BigramLM:
    """Tiny LM: next-token logits depend only on the current token."""

    def __init__(self, emb, proj):
        self.emb, self.proj = emb, proj

    def logits(self, tokens):
        return torch.tanh(self.emb[tokens]) @ self.proj


class SpeculativeDecoder:
    def __init__(self, draft, target, first_tokens):
        self.draft, self.target = draft, target
        self.draft_stream = torch.cuda.Stream(device=DEV)
        self.last_token = first_tokens.clone()  # [B] written by verify
        self.draft_tokens = torch.zeros(BATCH, K, dtype=torch.long, device=DEV)
        self.generated = torch.full((BATCH, ROUNDS * (K + 1)), -1, dtype=torch.long, device=DEV)
        self.num_accepted = torch.zeros(BATCH, dtype=torch.long, device=DEV)
        self.pos = torch.arange(K + 1, device=DEV)

    def propose(self):
        tok = self.last_token
        for j in range(K):
            tok = self.draft.logits(tok).argmax(-1)
            self.draft_tokens[:, j] = tok

    def verify(self, rnd):
        seq = torch.cat([self.last_token[:, None], self.draft_tokens], dim=1)
        tgt = self.target.logits(seq).argmax(-1)  # [B, K+1]
        match = tgt[:, :K] == self.draft_tokens
        n_acc = match.long().cumprod(1).sum(1)  # accepted prefix length
        bonus = tgt.gather(1, n_acc[:, None])  # target's token after the prefix
        padded = torch.cat([self.draft_tokens, bonus], dim=1)
        block = torch.where(self.pos[None, :] < n_acc[:, None], padded, -1)
        block.scatter_(1, n_acc[:, None], bonus)
        self.generated[:, rnd * (K + 1):(rnd + 1) * (K + 1)] = block
        self.num_accepted += n_acc
        self.last_token.copy_(bonus.squeeze(1))

    def run(self):
        main = torch.cuda.current_stream()
        for rnd in range(ROUNDS):
            with torch.cuda.stream(self.draft_stream):
                self.propose()
                self.draft_stream.wait_stream(main)
            main.wait_stream(self.draft_stream)
            self.verify(rnd)
        return self.generated, self.num_accepted


def main():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(VOCAB, HID, generator=g)
    proj = torch.randn(HID, VOCAB, generator=g) * HID ** -0.5
    noise = torch.randn(HID, VOCAB, generator=g) * HID ** -0.5
    draft = BigramLM(emb.to(DEV), proj.to(DEV))
    target = BigramLM(emb.to(DEV), (proj + 0.3 * noise).to(DEV))
    first = torch.randint(0, VOCAB, (BATCH,), generator=g).to(DEV)
    dec = SpeculativeDecoder(draft, target, first)
    torch.cuda.synchronize()  # weights and buffers ready

    with torch.no_grad():
        generated, accepted = dec.run()
    torch.cuda.synchronize()
    rate = accepted.sum().item() / (BATCH * ROUNDS * K)
    print(f"acceptance rate {rate:.3f}, first row {generated[0, :K + 1].tolist()}")


if __name__ == "__main__":
    main()
