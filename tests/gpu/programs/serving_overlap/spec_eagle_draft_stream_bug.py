# Source: plausible pattern modelled on EAGLE-style speculative decoding in
# vLLM v1 (vllm/v1/spec_decode/eagle.py, EagleProposer.propose) and SGLang
# (python/sglang/srt/speculative/eagle_worker.py), in the variant where the
# draft head is launched on a dedicated side stream (self.draft_stream) so that
# it can overlap with the target model's bookkeeping on the main stream.
#
# Race (device-device, read-after-write): the draft stream writes the proposed
# tokens into `draft_tokens` (draft_tokens[:, i] = t inside the draft loop);
# the verification forward on the main (default) stream reads `draft_tokens`
# (torch.cat into the verify sequence, and the acceptance test) with no
# ordering edge from the draft stream (no event wait / wait_stream), so the
# target model can verify the zero-initialised placeholder instead of the
# proposal.
# Fix: make the main stream wait for the draft stream before verification
# (torch.cuda.current_stream().wait_stream(self.draft_stream)).
import torch
import torch.nn as nn

DEV = "cuda:0"
V, H, B, K, STEPS = 8192, 512, 64, 4, 12
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait: the draft head is slow under load


class TinyTarget(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.l1 = nn.Linear(H, H)
        self.l2 = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        h = self.l2(torch.tanh(self.l1(self.embed(ids))))
        return h, self.lm_head(h)


class EagleHead(nn.Module):
    """Draft head: consumes the target's hidden state and the last token."""

    def __init__(self, embed, lm_head):
        super().__init__()
        self.fc = nn.Linear(2 * H, H)
        self.layer = nn.Linear(H, H)
        self.embed = embed  # shared with the target model
        self.lm_head = lm_head  # shared with the target model

    def forward(self, h, ids):
        x = torch.cat([h, self.embed(ids)], dim=-1)
        x = self.layer(torch.tanh(self.fc(x)))
        return x, self.lm_head(x)


class SpecDecoder:
    def __init__(self):
        self.target = TinyTarget().to(DEV).eval()
        self.drafter = EagleHead(self.target.embed, self.target.lm_head).to(DEV).eval()
        self.draft_stream = torch.cuda.Stream()

    @torch.inference_mode()
    def step(self, last_tokens):
        main = torch.cuda.current_stream()
        # target pass over the last accepted token -> hidden state + bonus token
        h, logits = self.target(last_tokens)
        bonus = logits.argmax(dim=-1)
        draft_tokens = torch.zeros(B, K, dtype=torch.long, device=DEV)

        # EAGLE draft head proposes K tokens on its own stream
        self.draft_stream.wait_stream(main)
        with torch.cuda.stream(self.draft_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            x, t = h, bonus
            for i in range(K):
                x, dlogits = self.drafter(x, t)
                t = dlogits.argmax(dim=-1)
                draft_tokens[:, i] = t

        # BUG: no ordering edge from the draft stream: the verification below
        # may read draft_tokens before the draft stream has written them.

        # verification of the K draft tokens on the main stream
        seq = torch.cat([bonus[:, None], draft_tokens], dim=1)  # [B, K+1]
        _, vlogits = self.target(seq)
        target_pred = vlogits.argmax(dim=-1)  # [B, K+1]
        match = (target_pred[:, :K] == draft_tokens).long()
        num_accepted = match.cumprod(dim=1).sum(dim=1)  # [B]
        next_tokens = target_pred.gather(1, num_accepted[:, None]).squeeze(1)
        pos_w = torch.arange(1, K + 1, device=DEV)
        stats = torch.stack([
            (target_pred * torch.arange(1, K + 2, device=DEV)).sum(),
            (draft_tokens * pos_w).sum(),
            num_accepted.sum(),
        ])
        # the scheduler needs the accepted counts on the host every step
        torch.cuda.synchronize()
        return next_tokens, stats.tolist()


def main():
    torch.manual_seed(0)
    dec = SpecDecoder()
    tokens = torch.randint(0, V, (B,), device=DEV)
    checksum = 0
    for _ in range(STEPS):
        tokens, stats = dec.step(tokens)
        checksum = (checksum * 1000003 + stats[0] * 7 + stats[1] * 3 + stats[2]) % (1 << 61)
    torch.cuda.synchronize()
    print(f"spec_eagle_draft_stream checksum: {checksum}")


if __name__ == "__main__":
    main()
