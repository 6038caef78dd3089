"""A CPU stand-in for the GPU decode benchmark: the real torch tracer, with CPU tensors playing CUDA's part.

    python bench/standin.py [--offloading] [--slot native|python]  # best-of-N times: plain, floor, trace
    valgrind --tool=callgrind --instr-atstart=no python bench/standin.py --count trace [--offloading]

The tracer runs on the stand-in of ``tests/support/standin.py`` (CPU tensors count as CUDA tensors of device 0,
through the tracer's device configuration), and a random tiny Qwen3 decodes on the CPU under it. Each fresh output
is announced as an allocation through PyTorch's GPU trace registries, as CUDA's allocator would, and freed 8 ops
later, between ops. Shared hosts make timings noisy; ``--count MODE`` instead runs one decode with callgrind's
instrumentation switched on (``callgrind_control``), so that the instruction counts of two versions or modes can be
compared exactly. Modes: those of ``tests.support.standin.StandIn``. ``--offloading`` decodes with a cache that does what
transformers' ``DynamicCache(offloading=True)`` does at each layer, on two stand-in streams: the default stream waits
for the prefetch stream (an event record and wait through the GPU trace registries), the next layer is copied on the
prefetch stream, the layer is updated and then copied on the default stream (the offload), so the event callbacks,
stream switches and cross-stream copies and frees of that workload are counted too. ``--slot`` fires the events
through PyTorch's GPU-trace slot instead, as CUDA code does, held by the native observer or by PyTorch's own
interpreter, so the two carriers' costs can be compared.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # (streamsan and the tests package of this checkout)

import torch  # noqa: E402

import torch.cuda._gpu_trace as gt  # noqa: E402

from tests.support.standin import CURRENT_STREAM, StandIn, fire, through_slot  # noqa: E402


class StandInStream:
    """A stream of the stand-in: its raw handle is current inside ``with``; ``wait_stream`` fires the event record
    and wait that CUDA's would."""

    last_event = 1000

    def __init__(self, handle: int):
        self.handle = handle

    def __enter__(self):
        self.previous, CURRENT_STREAM[0] = CURRENT_STREAM[0], self.handle

    def __exit__(self, *exc):
        CURRENT_STREAM[0] = self.previous

    def wait_stream(self, other: StandInStream) -> None:
        StandInStream.last_event += 1
        fire("record", StandInStream.last_event, other.handle)
        fire("wait", StandInStream.last_event, self.handle)


def decode_loop(steps: int = 16, offloading: bool = False):
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    model = Qwen3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 32000, (1, 16))
    default, prefetch = StandInStream(7), StandInStream(9)

    class OffloadingCache(DynamicCache):
        """The order of work of ``DynamicCache(offloading=True)``'s update, with copies on stand-in streams."""

        def update(self, keys, values, layer_idx, *args, **kwargs):
            default.wait_stream(prefetch)
            following = (layer_idx + 1) % cfg.num_hidden_layers
            if following < len(self.layers) and self.layers[following].is_initialized:
                with prefetch:
                    layer = self.layers[following]
                    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            keys, values = super().update(keys, values, layer_idx, *args, **kwargs)
            layer = self.layers[layer_idx]
            layer.keys, layer.values = keys.clone(), values.clone()
            return keys, values

    cache_class = OffloadingCache if offloading else DynamicCache

    @torch.no_grad()
    def run():
        cache = cache_class(config=model.config)
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", metavar="MODE", help="one decode under MODE with callgrind's instrumentation on")
    p.add_argument("--runs", type=int, default=12)
    p.add_argument("--offloading", action="store_true", help="decode with the offloading cache's order of work")
    p.add_argument("--slot", choices=("native", "python"),
                   help="fire the stand-in's GPU-trace events through PyTorch's GPU-trace slot, held by the native "
                        "observer or by PyTorch's own interpreter (default: call the registries directly)")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.slot:
        why = through_slot(a.slot)
        if why:
            sys.exit(f"bench/standin.py: --slot {a.slot}: {why}")
    with StandIn() as standin:
        measure(standin.enter, decode_loop(offloading=a.offloading), a)


def measure(enter, run, a) -> None:
    """One decode under ``a.count`` counted by callgrind, or the best-of-``a.runs`` times of each mode."""
    if a.count:
        m = enter(a.count)
        run()
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], stdout=subprocess.DEVNULL)
        run()
        subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], stdout=subprocess.DEVNULL)
        if m is not None:
            m.__exit__(None, None, None)
        return
    best = {}
    for r in range(a.runs + 1):
        for name in ("plain", "floor", "trace-python", "trace"):
            m = enter(name)
            t = time.thread_time()
            run()
            dt = time.thread_time() - t
            if m is not None:
                m.__exit__(None, None, None)
            if r:
                best[name] = min(best.get(name, dt), dt)
    print("  ".join(f"{k} {v:.4f}s" for k, v in best.items()),
          f"| above floor: trace-python {(best['trace-python'] - best['floor']) / best['plain']:.2f}x plain,",
          f"trace {(best['trace'] - best['floor']) / best['plain']:.2f}x plain")


if __name__ == "__main__":
    main()
