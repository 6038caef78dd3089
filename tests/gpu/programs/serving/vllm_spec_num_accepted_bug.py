# Source: vLLM PR #36013 "[Bugfix] Fix race in non-blocking num_accepted_tokens
# GPU->CPU copy" (vllm/v1/worker/gpu_model_runner.py).  With speculative
# decoding on a hybrid (Mamba/GDN) model and async scheduling,
# _update_states_after_model_execute copies num_accepted_tokens GPU -> pinned
# CPU with non_blocking=True, and the numpy view of that pinned buffer is read
# by the host in the next step's _build_attention_metadata.  Async scheduling
# deliberately avoids any CUDA sync in between, so the host may read the buffer
# before the DMA has landed.
import numpy as np
import torch
import torch.nn.functional as F

DEV = torch.device("cuda:0")
NUM_REQS, HIDDEN, VOCAB, NUM_SPEC, NUM_STEPS = 64, 1024, 8192, 2, 8


class InputBatch:
    def __init__(self):
        self.num_accepted_tokens_cpu_tensor = torch.ones(
            NUM_REQS, dtype=torch.int64, pin_memory=True)
        self.num_accepted_tokens_cpu = self.num_accepted_tokens_cpu_tensor.numpy()
        self.num_computed_tokens_cpu = np.full(NUM_REQS, 32, dtype=np.int64)


class GPUModelRunner:
    def __init__(self):
        g = torch.Generator(device=DEV).manual_seed(0)
        self.embed = torch.randn(VOCAB, HIDDEN, device=DEV, generator=g) * 0.05
        self.w_mix = torch.randn(HIDDEN, HIDDEN, device=DEV, generator=g) * 0.02
        self.lm_head = torch.randn(HIDDEN, VOCAB, device=DEV, generator=g) * 0.05
        self.ssm_state = torch.zeros(NUM_REQS, NUM_SPEC + 1, HIDDEN, device=DEV)
        self.last_token = torch.randint(0, VOCAB, (NUM_REQS, 1), device=DEV, generator=g)
        self.input_batch = InputBatch()
        self.sampled = []

    # ---- speculative proposer (EAGLE-like draft head sharing the embedding) ----
    def propose_draft_tokens(self, n):
        tok, drafts = self.last_token[:n], []
        for _ in range(NUM_SPEC):
            h = F.embedding(tok, self.embed)                     # [n, 1, H]
            tok = (h @ self.lm_head).argmax(dim=-1)               # [n, 1]
            drafts.append(tok)
        return torch.cat(drafts, dim=1)                           # [n, NUM_SPEC]

    def _build_attention_metadata(self, n):
        # Host-side metadata for the GDN spec-decode kernels: which of the
        # NUM_SPEC+1 cached SSM states each request continues from.
        num_accepted = self.input_batch.num_accepted_tokens_cpu[:n]
        state_idx = num_accepted - 1
        self.input_batch.num_computed_tokens_cpu[:n] += num_accepted
        max_seq_len = int(self.input_batch.num_computed_tokens_cpu[:n].max())
        return {"num_actual": n, "state_idx_np": state_idx, "max_seq_len": max_seq_len}

    def _model_forward(self, input_ids, attn_md):
        n = attn_md["num_actual"]
        h = F.embedding(input_ids, self.embed)                    # [n, K+1, H]
        h = h + torch.tanh(h @ self.w_mix + self.ssm_state[:n])
        self.ssm_state[:n] = 0.9 * self.ssm_state[:n] + 0.1 * h
        return h @ self.lm_head                                   # [n, K+1, V]

    def _rejection_sample(self, logits, draft):
        target = logits.argmax(dim=-1)                            # [n, K+1]
        match = (target[:, :NUM_SPEC] == draft).to(torch.int64)
        num_accepted = match.cumprod(dim=1).sum(dim=1) + 1        # [n]
        bonus = target.gather(1, (num_accepted - 1).unsqueeze(1)) # [n, 1]
        return bonus, num_accepted

    def _update_states_after_model_execute(self, num_accepted, n):
        self.input_batch.num_accepted_tokens_cpu_tensor[:n].copy_(
            num_accepted, non_blocking=True)

    def execute_model(self, n):
        attn_md = self._build_attention_metadata(n)
        draft = self.propose_draft_tokens(n)
        input_ids = torch.cat([self.last_token[:n], draft], dim=1)
        logits = self._model_forward(input_ids, attn_md)
        bonus, num_accepted = self._rejection_sample(logits, draft)
        self.last_token[:n].copy_(bonus)
        self._update_states_after_model_execute(num_accepted, n)
        self.sampled.append(bonus)  # consumed later by the async output thread


def main():
    runner = GPUModelRunner()
    torch.cuda.synchronize()
    for _ in range(NUM_STEPS):
        runner.execute_model(NUM_REQS)  # no host<->device sync (async scheduling)
    torch.cuda.synchronize()
    toks = torch.cat(runner.sampled, dim=1).cpu()
    print("tokens:", toks.shape, "computed:", runner.input_batch.num_computed_tokens_cpu[:4])


if __name__ == "__main__":
    main()
