"""A transformers model decoding with DynamicCache(offloading=True): the offloaded-cache stream race.

    python examples/transformers_offloaded_cache.py --model qwen3          # dense Qwen3, random weights
    python examples/transformers_offloaded_cache.py --model qwen3_next     # hybrid: Gated DeltaNet + attention
    python examples/transformers_offloaded_cache.py --fixed                # the cache with both edges added
    python examples/transformers_offloaded_cache.py --stress 200           # GPU busy: the race corrupts logits

Run it under ``streamsan wrap -- python examples/transformers_offloaded_cache.py``: with the GPU idle the outputs
match, and streamsan still reports 4 findings, the two hazards of the cache on a layer's keys and on its
values: the prefetch's H2D copy reads pinned memory that the offload's D2H copy may still be writing
(device-device), and a prefetched tensor is freed without record_stream (missing-record-stream).
The bundled ``reports/transformers-48947.*`` were made from this script (``reports/README.md`` says how).
Needs a CUDA GPU and transformers 5.x; nothing is downloaded.
"""

import argparse

import torch
from transformers import DynamicCache

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", choices=("qwen3", "qwen3_next"), default="qwen3")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--seq", type=int, default=256, help="prompt length")
p.add_argument("--steps", type=int, default=3, help="decode steps after the prefill")
p.add_argument("--fixed", action="store_true", help="add the two missing edges to the cache")
p.add_argument("--stress", type=float, default=0, help="ms of GPU sleep on the default stream before the prefill")
args = p.parse_args()


def build_model():
    torch.manual_seed(0)
    if args.model == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=args.layers,
                          num_attention_heads=4, num_key_value_heads=4, head_dim=128)
        model = Qwen3ForCausalLM(cfg)
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)]
        cfg = Qwen3NextConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=args.layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=128, linear_num_value_heads=4,
                              linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
                              moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=4,
                              num_experts_per_tok=2, layer_types=types)
        model = Qwen3NextForCausalLM(cfg)
    model = model.to("cuda", torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    return model


def add_missing_edges():
    """The fix: the prefetch stream waits for the offload's D2H copy, and prefetched tensors record the stream
    that consumes them."""
    from transformers import cache_utils

    cache_prefetch = cache_utils.Cache.prefetch
    layer_prefetch = cache_utils.CacheLayerMixin.prefetch

    def prefetch(self, layer_idx, only_non_sliding=True):
        self.prefetch_stream.wait_stream(torch.cuda.current_stream())
        cache_prefetch(self, layer_idx, only_non_sliding)

    def prefetch_layer(self):
        layer_prefetch(self)
        if self.is_initialized and self.keys.is_cuda:
            consumer = torch.cuda.default_stream(self.keys.device)
            self.keys.record_stream(consumer)
            self.values.record_stream(consumer)

    cache_utils.Cache.prefetch = prefetch
    cache_utils.CacheLayerMixin.prefetch = prefetch_layer


@torch.no_grad()
def decode(model, ids, offloading, tokens=None):
    """Greedy decode; ``tokens`` feeds given tokens instead, so two runs see the same inputs."""
    cache = DynamicCache(config=model.config, offloading=offloading)
    if args.stress:
        torch.cuda._sleep(int(args.stress * 2e6))  # about 2e6 cycles per ms on an H200
    out = model(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1].float()]
    fed = []
    for step in range(args.steps):
        tok = tokens[step] if tokens is not None else logits[-1].argmax(-1, keepdim=True)
        fed.append(tok)
        out = model(tok, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
    torch.cuda.synchronize()
    return torch.stack(logits), fed


if args.fixed:
    add_missing_edges()
model = build_model()
ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device="cuda")
plain, tokens = decode(model, ids, offloading=False)
offloaded, _ = decode(model, ids, offloading=True, tokens=tokens)
diff = (plain - offloaded).abs().max().item()
same = bool((plain.argmax(-1) == offloaded.argmax(-1)).all())
print(f"{args.model}: max |logits(offloaded) - logits(resident)| = {diff:.4g}, argmax match: {same}")
