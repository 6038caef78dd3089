# Source: plausible pattern on the real transformers 5.x generate loop
# (GenerationMixin._sample: next_token_logits = outputs.logits[:, -1].to(copy=True,
# ...) on the compute stream, then logits_processor(input_ids, next_token_logits)).
# A LogitsProcessor that does side-stream work to keep monitoring off the sampling
# critical path, in the spirit of mlc-ai/mlc-llm PR #2058 (copy stream in the
# LogitProcessor) and dottxt-ai/outlines#1434 (async logits-processor work).
# The processor records per-step entropy of the next-token distribution on a side
# stream; it correctly calls scores.record_stream(side) because generate drops the
# logits while the side stream may still read them.
# BUG: the side stream never waits for the compute stream, so it reads `scores`
# before the copy that produced them is ordered before it.
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

DEV = torch.device("cuda", 0)


class SideStreamEntropyMonitor(LogitsProcessor):
    def __init__(self, max_steps: int, batch_size: int):
        self.stream = torch.cuda.Stream(device=DEV)
        with torch.cuda.stream(self.stream):
            self.entropy = torch.zeros(max_steps, batch_size, device=DEV)
        self.step = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        with torch.cuda.stream(self.stream):
            logp = torch.log_softmax(scores, dim=-1)
            self.entropy[self.step] = -(logp.exp() * logp).sum(dim=-1)
        scores.record_stream(self.stream)
        self.step += 1
        return scores  # monitoring only: scores pass through unchanged

    def summary(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        return self.entropy[: self.step].mean(dim=0).tolist()


def build_model():
    config = LlamaConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(DEV).eval()


def main():
    model = build_model()
    batch, prompt_len, new_tokens = 4, 16, 12
    torch.manual_seed(1)
    input_ids = torch.randint(3, 4096, (batch, prompt_len), device=DEV)
    attention_mask = torch.ones_like(input_ids)
    monitor = SideStreamEntropyMonitor(max_steps=new_tokens, batch_size=batch)
    torch.cuda.synchronize()
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=attention_mask, do_sample=False,
            max_new_tokens=new_tokens,
            logits_processor=LogitsProcessorList([monitor]),
        )
    print("generated", tuple(out.shape))
    print("mean entropy per sequence", [round(e, 3) for e in monitor.summary()])


if __name__ == "__main__":
    main()
