"""Side-by-side overhead on a GPU: plain, a no-op dispatch mode (the Python floor), streamsan and CSAN.

    python bench/bench.py                                # every workload, every mode
    python bench/bench.py --workloads decode,micro --runs 5

Workloads: ``decode`` / ``decode_offload``: greedy decode of a random 8-layer Qwen3 (hidden
1024, 8 heads, head_dim 128, 512-token prompt, 32 steps), resident or with DynamicCache(offloading=True);
``big_decode``: a random ~6.5B Qwen3 (hidden 4096, 32 layers, 32 heads, 8 KV heads) decoding at batch 8 after a
2048-token prompt; ``big_prefill``: the same model, 3 forwards of batch 8 x 4096 tokens; ``micro``: 100k small
elementwise ops over 4 streams with events and waits.

Modes: ``plain``; ``floor`` (a TorchDispatchMode that only calls the op); ``callbacks`` (PyTorch's GPU trace
callbacks switched on, reaching no tracer: what the hooks scope pays from its first hooked region that uses a
second stream on); ``record`` (streamsan tracing into a trace file, as each process under ``streamsan wrap`` does;
the analysis runs afterwards in the wrapping process); ``inline`` (``streamsan.watch(helper=False)``: tracing plus
in-process analysis); ``full`` (``streamsan.watch()``: tracing, the analysis in a helper process); ``full-c``
(``full`` without the dispatch lane, ``STREAMSAN_CORE=c``: PyTorch's Python dispatch into the C tracer, what the
lane saves); ``full-py`` (``full`` with the Python tracer alone, ``STREAMSAN_CORE=python``); ``hooks``
(``--scope hooks``: only inside the transformers cache hooks); ``csan`` (torch.cuda._sanitizer). GPU trace
callbacks, once activated, stay on for the process, so each workload runs in its own process: plain and floor
interleaved over ``--runs`` passes (with ``hooks`` where no offloading cache turns the callbacks on), then
streamsan's modes interleaved, then CSAN (one timed run); one warm-up run each. Each mode's time is its best run:
the shared host's noise only ever adds time (consecutive plain runs differ by up to 20% there); stderr has each
mode's median and every run's time, its garbage collection time and, for streamsan's modes, the time spent feeding
the analysis helper (:class:`RunCosts`).
Prints one table: each mode's time and its ratio to plain, to the floor and to CSAN.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import streamsan  # noqa: E402
from streamsan.session import Session  # noqa: E402


class NoOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def qwen3(hidden, layers, heads, kv_heads, head_dim, inter, vocab=32000):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=16384)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = Qwen3ForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model


def decode_workload(model, batch, prompt, steps, offloading):
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")

    @torch.no_grad()
    def run():
        cache = DynamicCache(config=model.config, offloading=offloading)
        out = model(ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
    return run


def prefill_workload(model, batch, prompt, forwards):
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")

    @torch.no_grad()
    def run():
        for _ in range(forwards):
            model(ids, use_cache=False)
        torch.cuda.synchronize()
    return run


def micro_workload(n_ops=100_000, n_streams=4):
    streams = [torch.cuda.Stream() for _ in range(n_streams)]
    xs = [torch.ones(256, device="cuda") for _ in range(n_streams)]

    def run():
        for i in range(n_ops // n_streams):
            for k, s in enumerate(streams):
                with torch.cuda.stream(s):
                    xs[k].add_(1.0)
            if i % 16 == 15:  # pass values around the ring, ordered by events
                for k, s in enumerate(streams):
                    e = torch.cuda.Event()
                    e.record(s)
                    streams[(k + 1) % n_streams].wait_event(e)
        torch.cuda.synchronize()
    return run


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class RunCosts:
    """What a timed run spent outside the program's own work, for stderr: the garbage collector's time by
    generation, and (streamsan's modes) the time in the analysis helper's ``feed`` (marshal and the pipe write,
    which blocks while the helper is behind) with the events fed."""

    def __init__(self):
        import gc

        from streamsan import helper

        self.gc, self.helper = gc, helper
        self.gc_s = [0.0, 0.0, 0.0]
        self.gc_n = [0, 0, 0]
        self.feed_s = 0.0
        self.events = 0
        self._t = 0.0

    def _on_gc(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info["generation"]
            self.gc_s[g] += time.perf_counter() - self._t
            self.gc_n[g] += 1

    def __enter__(self):
        cls = self.helper.AnalysisHelper
        self._feed = cls.__dict__["feed"]
        orig, costs = self._feed, self

        def feed(helper, batch):
            t = time.perf_counter()
            try:
                return orig(helper, batch)
            finally:
                costs.feed_s += time.perf_counter() - t
                costs.events += len(batch)

        cls.feed = feed
        self.gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        self.gc.callbacks.remove(self._on_gc)
        self.helper.AnalysisHelper.feed = self._feed

    def text(self):
        gcs = " ".join(f"gen{g} {n}x {s * 1e3:.1f}ms" for g, (n, s) in enumerate(zip(self.gc_n, self.gc_s)) if n)
        fed = f", feed {self.feed_s * 1e3:.1f}ms for {self.events} events" if self.events else ""
        return f"gc: {gcs or 'none'}{fed}"


class Mode:
    """A measuring mode: ``enter()`` / ``exit()`` around timed runs."""

    def __init__(self, name, tmp):
        self.name = name
        self.tmp = tmp
        self.ctx = None

    def enter(self):
        if self.name == "floor":
            self.ctx = NoOp()
            self.ctx.__enter__()
        elif self.name == "callbacks":
            from streamsan.tracers.torch.callbacks import GpuTrace

            from streamsan.tracers.torch import trace_slot

            GpuTrace.install()  # PyTorch's GPU trace callbacks on, reaching no tracer
            trace_slot.quiet(False)  # (forwarded all the same: after a session, the native carrier stops)
        elif self.name == "record":
            self.ctx = Session(trace_path=os.path.join(self.tmp, f"bench-{time.time_ns()}.sstrace"),
                               analyze=False, compress_trace=False).start()  # uncompressed, as under wrap
        elif self.name == "inline":
            self.ctx = streamsan.watch(helper=False).start()
        elif self.name in ("full-py", "full-c"):
            os.environ["STREAMSAN_CORE"] = "python" if self.name == "full-py" else "c"
            self.ctx = streamsan.watch().start()
        elif self.name in ("full", "hooks"):
            self.ctx = streamsan.watch(scope="full" if self.name == "full" else "hooks").start()
        elif self.name == "csan":
            import torch.cuda._sanitizer as csan

            self.ctx = csan.CUDASanitizer()
            self.ctx.enable()

    def exit(self):
        if self.ctx is None:
            return
        if self.name == "floor":
            self.ctx.__exit__(None, None, None)
        elif self.name == "csan":
            self.ctx.disable()
        else:
            self.ctx.stop()
        self.ctx = None
        os.environ.pop("STREAMSAN_CORE", None)


def measure_rounds(names, fn, rounds, tmp):
    """Interleave the modes over ``rounds`` rounds (after one warm-up each), so that drifts of the machine hit every
    mode alike; each mode's best run (its median goes to stderr)."""
    times = {n: [] for n in names}
    costs_of = {n: [] for n in names}
    for r in range(rounds + 1):
        for n in names:
            m = Mode(n, tmp)
            m.enter()
            try:
                with RunCosts() as costs:
                    t = timed(fn)
            finally:
                m.exit()
            if r:
                times[n].append(t)
                costs_of[n].append(costs.text())
    for n, v in times.items():
        print(f"  {n:9s} median {statistics.median(v):8.3f}s over {len(v)} runs", file=sys.stderr, flush=True)
        for t, c in zip(v, costs_of[n]):
            print(f"    {t:8.3f}s  {c}", file=sys.stderr, flush=True)
    return {n: min(v) for n, v in times.items()}


WORKLOADS = ("decode", "decode_offload", "micro", "big_decode", "big_prefill")
MODES = ("plain", "floor", "callbacks", "record", "hooks", "inline", "full", "full-c", "full-py", "csan")


def run_workload(w, modes, runs, big_runs):
    tmp = tempfile.mkdtemp()
    if w in ("decode", "decode_offload"):
        fn = decode_workload(qwen3(1024, 8, 8, 8, 128, 3072), 1, 512, 32, offloading=(w == "decode_offload"))
    elif w == "micro":
        fn = micro_workload()
    elif w in ("big_decode", "big_prefill"):
        big = qwen3(4096, 32, 32, 8, 128, 11008)
        fn = decode_workload(big, 8, 2048, 32, False) if w == "big_decode" else prefill_workload(big, 8, 4096, 3)
        runs = big_runs
    else:
        raise SystemExit(f"unknown workload {w}")
    skip = {"hooks"} if w in ("micro", "big_prefill") else set()  # no hooked library code runs there
    # PyTorch's GPU trace callbacks stay on once streamsan or CSAN turned them on: plain and floor first, then
    # streamsan's modes, CSAN (whose callbacks cannot be removed) last, with a single timed run. The hooks scope
    # turns them on only in a hooked region that uses a second stream (an offloading cache): where none runs, it
    # is measured with plain and floor, as a program under it runs.
    hooks_early = w in ("decode", "big_decode")
    before = [m for m in modes if m in ("plain", "floor") or (m == "hooks" and hooks_early)]
    after = [m for m in modes if m in ("callbacks", "record", "inline", "full", "full-c", "full-py")
             or (m == "hooks" and not hooks_early)]
    after = [m for m in after if m not in skip]
    res = measure_rounds(before, fn, runs, tmp)
    from streamsan.tracers.torch import trace_slot
    from streamsan.tracers.torch.callbacks import GpuTrace

    if GpuTrace.installed and trace_slot.CARRIER == "python":  # (the native carrier is quiet after a session)
        print(f"  {w}: the hooks scope turned PyTorch's GPU trace callbacks on: the plain and floor runs after its "
              "first run paid them too", file=sys.stderr, flush=True)
    res.update(measure_rounds(after, fn, runs, tmp))
    if "csan" in modes:
        res.update(measure_rounds(["csan"], fn, 1, tmp))
    for m, t in res.items():
        print(f"  {w:15s} {m:7s} {t:8.3f}s", file=sys.stderr, flush=True)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--big-runs", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    modes = [m for m in MODES if m in a.modes.split(",")]
    if a.child:  # one workload per process: CSAN's callbacks cannot be removed once registered
        print(json.dumps(run_workload(a.child, modes, a.runs, a.big_runs)))
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}", flush=True)
    rows = []
    for w in a.workloads.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", w, "--modes", ",".join(modes), "--runs",
                              str(a.runs), "--big-runs", str(a.big_runs)], stdout=subprocess.PIPE, text=True)
        if out.returncode != 0:
            print(f"{w}: failed with exit code {out.returncode}", flush=True)
            continue
        rows.append((w, json.loads(out.stdout.strip().splitlines()[-1])))
    print()
    print(f"{'workload':15s} {'mode':7s} {'seconds':>8s} {'x plain':>8s} {'x floor':>8s} {'CSAN / mode':>11s}")
    for w, res in rows:
        for m, t in res.items():
            fl = res.get("floor")
            cs = res.get("csan")
            print(f"{w:15s} {m:7s} {t:8.3f} {t / res['plain']:8.2f} {t / fl if fl else float('nan'):8.2f} "
                  f"{cs / t if cs else float('nan'):11.2f}")


if __name__ == "__main__":
    main()
