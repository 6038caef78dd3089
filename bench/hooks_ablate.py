"""Where the hooks scope's time goes on the offloading decode loop (GPU), by ablation.

    python bench/hooks_ablate.py [--runs 5]

Modes: ``plain`` (first, alone: PyTorch's GPU trace callbacks stay on once switched on); then, interleaved over
``--runs`` rounds, ``callbacks`` (the callbacks on, reaching no tracer), ``hooks`` (``--scope hooks``),
``no-labels`` (hooks without the cache labels), ``py-path-untraced`` (hooks whose ops on the Python path, the
copies to and from pinned memory, only run), ``regions-untraced`` (the hooks' wrappers and contexts, no tracing in
their regions). Prints each mode's best and median run and its best against plain's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import decode_workload, qwen3  # noqa: E402

import streamsan  # noqa: E402
from streamsan.tracers.torch import dispatch  # noqa: E402
from streamsan.tracers.torch.callbacks import GpuTrace  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402

ORIGINAL = {(TorchTracer, n): getattr(TorchTracer, n) for n in ("label", "push_context", "pop_context")}
ORIGINAL[dispatch, "dispatch"] = dispatch.dispatch  # (the Python path the mode calls)


def _run_op(tracer, func, args, kwargs, plan=None):
    return func(*args, **kwargs)


def _push_context_only(self, text):
    prev = self.ctx
    self.ctx = self.buffer.context_id(text)
    return prev


def _pop_context_only(self, prev):
    self.ctx = prev


ABLATIONS = {
    "hooks": {},
    "no-labels": {(TorchTracer, "label"): lambda self, tensor, text: None},
    "py-path-untraced": {(dispatch, "dispatch"): _run_op},
    "regions-untraced": {(TorchTracer, "push_context"): _push_context_only,
                         (TorchTracer, "pop_context"): _pop_context_only},
}


def start(mode):
    """Set the tracer up for ``mode``; returns the session to stop after the run, or None."""
    for (owner, name), fn in ORIGINAL.items():
        setattr(owner, name, fn)
    if mode == "callbacks":
        GpuTrace.install()
        return None
    for (owner, name), fn in ABLATIONS[mode].items():
        setattr(owner, name, fn)
    return streamsan.watch(scope="hooks").start()


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    fn = decode_workload(qwen3(1024, 8, 8, 8, 128, 3072), 1, 512, 32, offloading=True)
    fn()
    times = {"plain": [timed(fn) for _ in range(a.runs)]}
    modes = ["callbacks", *ABLATIONS]
    for m in modes:
        times[m] = []
    for r in range(a.runs + 1):
        for m in modes:
            s = start(m)
            try:
                t = timed(fn)
            finally:
                if s is not None:
                    s.stop()
            if r:
                times[m].append(t)
    start("callbacks")  # (the originals back)
    plain = min(times["plain"])
    for m, v in times.items():
        print(f"{m:18s} best {min(v):.3f}s {min(v) / plain:.2f}x  median {statistics.median(v):.3f}s")


if __name__ == "__main__":
    main()
