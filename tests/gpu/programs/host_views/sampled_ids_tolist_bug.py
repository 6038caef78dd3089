# Source: vllm/v1/worker/gpu_model_runner.py, GPUModelRunner._to_list() (vLLM PR #22760 for issue #22754):
#   pinned = self.sampled_token_ids_pinned_cpu[: sampled_token_ids.shape[0]]
#   pinned.copy_(sampled_token_ids, non_blocking=True)
#   self.transfer_event.record(); self.transfer_event.synchronize()
#   return pinned.tolist()
# Bug: the transfer_event.record()/synchronize() pair is left out (as in forks that commented it out, thinking
#   ".tolist() of a CPU tensor is synchronous anyway"). The non_blocking D2H copy on the default stream writes the
#   persistent pinned buffer sampled_token_ids_pinned_cpu, and the host reads that same buffer with .tolist()
#   with no happens-before edge from the copy: while the forward is still running the host reads the previous
#   step's tokens, and the engine feeds them back as the next input.
# Fix: record transfer_event on the current stream right after the copy and transfer_event.synchronize() before
#   pinned.tolist(), exactly as upstream vLLM does.
import json
import pickle
from dataclasses import dataclass

import torch
import torch.nn as nn

VOCAB, HIDDEN, MAX_REQS, STEPS = 512, 256, 8, 6


class TinyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, simulate_big_model=True):
        h = self.embed_tokens(input_ids)
        if simulate_big_model:
            torch.cuda._sleep(40_000_000)  # stands in for the 60 decoder layers of a real model
        h = h + self.mlp(h)
        return self.lm_head(h)


@dataclass
class ModelRunnerOutput:
    req_ids: list
    sampled_token_ids: list


class GPUModelRunner:
    def __init__(self, model, device):
        self.model = model
        self.device = device
        self.sampled_token_ids_pinned_cpu = torch.zeros((MAX_REQS, 1), dtype=torch.int64, pin_memory=True)
        self.transfer_event = torch.cuda.Event()

    def _to_list(self, sampled_token_ids):
        pinned = self.sampled_token_ids_pinned_cpu[: sampled_token_ids.shape[0]]
        pinned.copy_(sampled_token_ids, non_blocking=True)
        return pinned.tolist()

    @torch.inference_mode()
    def execute_model(self, req_ids, input_ids):
        logits = self.model(input_ids)
        sampled_token_ids = logits.argmax(dim=-1, keepdim=True)  # greedy sampler
        valid_sampled_token_ids = self._to_list(sampled_token_ids)
        return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=valid_sampled_token_ids)


def detokenize(ids):
    return " ".join("tok%d" % i for i in ids)


def main():
    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = TinyDecoder().to(device).eval()
    runner = GPUModelRunner(model, device)

    req_ids = ["req-%d" % i for i in range(4)]
    last_tokens = [11, 42, 7, 300]
    generated = {r: [] for r in req_ids}
    for step in range(STEPS):
        input_ids = torch.tensor(last_tokens, dtype=torch.int64, device=device)
        output = runner.execute_model(req_ids, input_ids)
        wire = pickle.dumps(output)  # what the worker sends back to the engine core
        output = pickle.loads(wire)
        last_tokens = [t[0] for t in output.sampled_token_ids]
        for r, t in zip(output.req_ids, last_tokens):
            generated[r].append(t)
    print(json.dumps({r: detokenize(v) for r, v in generated.items()})[:200])

    # Reference: the same greedy decode with plain blocking .cpu() reads.
    torch.cuda.synchronize()
    ref_tokens = [11, 42, 7, 300]
    ref = {r: [] for r in req_ids}
    with torch.inference_mode():
        for step in range(STEPS):
            ids = torch.tensor(ref_tokens, dtype=torch.int64, device=device)
            tok = model(ids, simulate_big_model=False).argmax(dim=-1).cpu()
            ref_tokens = tok.tolist()
            for r, t in zip(req_ids, ref_tokens):
                ref[r].append(t)
    print("match=%s" % (ref == generated))


if __name__ == "__main__":
    main()
