# Source: plausible pattern modelled on top-k/top-p sampling as in vLLM
# (vllm/v1/sample/ops/topk_topp_sampler.py: apply_top_k_top_p followed by
# random_sample, the exponential-race form of torch.multinomial) moved onto a dedicated sampling stream so that sampling of
# micro-batch i overlaps with the LM-head forward of micro-batch i+1 (the
# overlap idea of SGLang's overlap scheduler / pipelined micro-batches).
#
# Race (missing record_stream): `logits` is allocated by the LM head on the
# default stream and consumed on self.sample_stream. The caller drops it right
# after launching the sampler, so the caching allocator puts its block back in
# the default stream's pool at once (it only knows about the allocating
# stream). The next micro-batch's LM head (default stream) is handed the same
# block and overwrites it while the sampling stream may not have read the old
# logits yet (it is still busy), so batch i is sampled from batch i+1's logits.
# Fix: logits.record_stream(self.sample_stream) when handing it to the sampler.
import torch
import torch.nn as nn

DEV = "cuda:0"
V, H, B, MICRO = 32000, 1024, 64, 12
TOP_K, TOP_P, TEMPERATURE = 50, 0.9, 0.8
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU busy-wait: the sampler is still busy


class LMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, h):
        return self.lm_head(torch.nn.functional.gelu(self.proj(h)))


class PipelinedSampler:
    def __init__(self):
        self.model = LMHead().to(DEV).eval()
        self.sample_stream = torch.cuda.Stream()
        self.generator = torch.Generator(device=DEV)
        self.generator.manual_seed(1234)
        self.sampled = torch.zeros(MICRO, B, dtype=torch.long, device=DEV)

    def sample_async(self, logits, mb):
        self.sample_stream.wait_stream(torch.cuda.current_stream())
        # FIX: keep the block from being reused until sample_stream is done.
        logits.record_stream(self.sample_stream)
        with torch.cuda.stream(self.sample_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            scaled = logits / TEMPERATURE
            topk_logits, topk_ids = scaled.topk(TOP_K, dim=-1)  # sorted, descending
            probs = topk_logits.softmax(dim=-1)
            cum = probs.cumsum(dim=-1)
            probs = probs.masked_fill((cum - probs) > TOP_P, 0.0)  # top-p
            # vLLM's random_sample(): equivalent to torch.multinomial(probs, 1)
            # but without multinomial's argument checks (which may sync the host)
            q = torch.empty_like(probs).exponential_(generator=self.generator)
            choice = probs.div(q).argmax(dim=-1, keepdim=True)
            self.sampled[mb].copy_(topk_ids.gather(-1, choice).squeeze(-1))

    @torch.inference_mode()
    def run(self, hidden):
        for mb in range(MICRO):
            logits = self.model(hidden[mb])  # [B, V] fp32, default stream
            self.sample_async(logits, mb)
            del logits
        torch.cuda.current_stream().wait_stream(self.sample_stream)
        return self.sampled


def main():
    torch.manual_seed(0)
    sampler = PipelinedSampler()
    hidden = torch.randn(MICRO, B, H, device=DEV)
    sampled = sampler.run(hidden)
    torch.cuda.synchronize()
    w = torch.arange(1, MICRO * B + 1, device=DEV).view(MICRO, B)
    print(f"sampler_stream_record_stream checksum: {(sampled * w).sum().item()}")


if __name__ == "__main__":
    main()
