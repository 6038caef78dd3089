"""What a native op observer would cost, and whether it sees what streamsan sees (issue 5, item 3): builds
bench/native_probe/observer.cpp (a global RecordFunction callback) and times it against the plain program, a no-op
Python TorchDispatchMode (the floor of a Python tracer) and streamsan's torch tracer.

    python bench/native_probe.py [--device cpu|cuda]

The observer runs at three levels: `native0` logs every dispatcher call's tensors; `native1` keeps only the ops a
dispatch mode sees, with each tensor's byte range and its device's current stream; `native2` adds the Python
call site (the GIL taken, three frames read). First the script checks that `native1` sees the same op sequence
as a dispatch mode on each workload, and prints where they differ.

Needs a C++ compiler and ninja (torch.utils.cpp_extension). On a machine without CUDA it runs on CPU tensors:
the per-op costs of interception are host costs either way, but streamsan's tracer then sees no device memory and
takes its short path, so its row is a lower bound there.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamsan.analyzer import Analyzer  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402


class NoOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def build():
    from torch.utils.cpp_extension import load

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_probe", "observer.cpp")
    return load(name="streamsan_native_probe", sources=[src], build_directory=tempfile.mkdtemp(),
                extra_cflags=["-O2", "-DNDEBUG"], verbose=False)


def micro(device, n=100_000):
    x = torch.ones(256, device=device)

    def run():
        for _ in range(n):
            x.add_(1.0)
        if device == "cuda":
            torch.cuda.synchronize()
    return run, n


def decode(device):
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    if device == "cuda":
        cfg = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=8, head_dim=128, vocab_size=32000)
        prompt, steps = 512, 32
    else:
        cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=1000)
        prompt, steps = 32, 32
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, cfg["vocab_size"], (1, prompt), device=device)

    @torch.no_grad()
    def run():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        if device == "cuda":
            torch.cuda.synchronize()

    NoOpCount.n = 0
    with NoOpCount():
        run()
    return run, NoOpCount.n


class NoOpCount(TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        NoOpCount.n += 1
        return func(*args, **(kwargs or {}))


class Names(TorchDispatchMode):
    """The op sequence a dispatch mode sees, named as streamsan names ops."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        s = func._schema
        self.seen.append(s.name + ("." + s.overload_name if s.overload_name else ""))
        return func(*args, **(kwargs or {}))


def compare(native, name, fn):
    """Whether native level 1 sees the dispatch mode's op sequence on fn; prints the first difference."""
    with Names() as m:
        fn()
    native.enable(1, True)
    try:
        fn()
    finally:
        native.disable()
        native.drain()
    got = native.seen()
    want = m.seen
    native.enable(2, False)
    try:
        fn()
    finally:
        native.disable()
    calls, accesses, sites = native.drain()
    same = got == want
    print(f"{name}: dispatch mode {len(want)} ops, native1 {len(got)} ops, identical: {same}; "
          f"native2: {calls} dispatcher calls, {accesses} tensor accesses, {sites} call sites")
    if not same:
        i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        print(f"  first difference at op {i}: mode {want[i:i + 4]} / native {got[i:i + 4]}")
        from collections import Counter
        diff = Counter(want)
        diff.subtract(Counter(got))
        odd = [(k, v) for k, v in diff.items() if v]
        print(f"  count differences (mode - native), {len(odd)} ops: {sorted(odd, key=lambda kv: -abs(kv[1]))[:12]}")
    return same


class Modes:
    def __init__(self, native):
        self.native = native
        self.ctx = None

    def enter(self, mode):
        if mode.startswith("native"):
            self.native.enable(int(mode[-1]), False)
        elif mode == "floor":
            self.ctx = NoOp()
            self.ctx.__enter__()
        elif mode == "streamsan":
            analyzer = Analyzer()
            self.ctx = TorchTracer(EventBuffer([analyzer.feed]))
            self.ctx.start()

    def exit(self, mode):
        if mode.startswith("native"):
            self.native.disable()
            self.native.drain()
        elif mode == "floor":
            self.ctx.__exit__(None, None, None)
        elif mode == "streamsan":
            self.ctx.stop()
        self.ctx = None


def measure(fn, modes, rounds):
    names = ("plain", "native0", "native1", "native2", "floor", "streamsan")
    times = {n: [] for n in names}
    for r in range(rounds + 1):
        for n in names:
            modes.enter(n)
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                dt = time.perf_counter() - t0
                modes.exit(n)
            if r:
                times[n].append(dt)
    return {n: statistics.median(v) for n, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    t0 = time.perf_counter()
    native = build()
    print(f"built the observer in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}, device {a.device}")
    modes = Modes(native)
    workloads = (("micro", micro(a.device)), ("decode", decode(a.device)))
    for name, (fn, _ops) in workloads:
        compare(native, name, fn)
    print(f"{'workload':9s} {'mode':10s} {'seconds':>8s} {'x plain':>8s} {'us/op over plain':>17s}")
    for name, (fn, ops) in workloads:
        res = measure(fn, modes, a.rounds)
        for m, t in res.items():
            print(f"{name:9s} {m:10s} {t:8.3f} {t / res['plain']:8.2f} {(t - res['plain']) / ops * 1e6:17.2f}")


if __name__ == "__main__":
    main()
