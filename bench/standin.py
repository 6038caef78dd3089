"""A CPU stand-in for the GPU decode benchmark: the real torch tracer, with CPU tensors playing CUDA's part.

    python bench/standin.py                       # best-of-N times: plain, floor, trace (no GPU needed)
    valgrind --tool=callgrind --instr-atstart=no python bench/standin.py --count trace [--rev REV]

The tracer's source (the working tree's, or ``--rev``'s from git) is loaded with its CUDA tests turned into CPU
tests, and a random tiny Qwen3 decodes on the CPU under it. Each fresh output is announced as an allocation
through PyTorch's GPU trace registries, as CUDA's allocator would, and freed 8 ops later, between ops. Shared
hosts make timings noisy; ``--count MODE`` instead runs one decode with callgrind's instrumentation switched on
(``callgrind_control``), so that the instruction counts of two versions or modes can be compared exactly.
Modes: ``plain``, ``floor`` (a no-op dispatch mode), ``trace`` (with the C tracer where built), ``trace-python``
(the Python tracer alone), ``trace-inactive`` (the mode and the harness
without the tracer's work), ``trace-nostack`` (stack capture replaced by a constant), ``trace-nocb`` (allocation
callbacks reaching no tracer).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.cuda._gpu_trace as gt  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from streamsan.agents import StreamRegistry  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.stacks import StackTable  # noqa: E402


def load_tracer(rev: str | None):
    """The torch tracer module, its CUDA tests made CPU tests (device index 0 for CPU tensors)."""
    path = os.path.join(ROOT, "streamsan", "tracers", "torch.py")
    src = subprocess.check_output(["git", "-C", ROOT, "show", f"{rev}:streamsan/tracers/torch.py"], text=True) \
        if rev else open(path).read()
    src = src.replace(".is_cuda", ".is_cpu").replace("t.is_cpu and self.pinned", "False")
    src = src.replace("elif v.is_cpu:", "elif False:").replace("get_device()", "get_device() + 1")
    src = src.replace("from .. import", "from streamsan import").replace("from ..", "from streamsan.")
    src = re.sub(r"^from \.(\w)", r"from streamsan.tracers.\1", src, flags=re.M)
    mod = types.ModuleType("streamsan_standin_tracer")
    mod.__file__ = path  # its frames count as streamsan's own
    exec(compile(src, path, "exec"), mod.__dict__)
    mod._cuda_raw_stream = lambda d: 7
    mod._cuda_get_device = lambda: 0
    mod._C_DEVICE_ATTR, mod._C_DEVICE_OFFSET = "is_cpu", 1  # the same for the C tracer
    return mod


def decode_loop(steps: int = 16):
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    model = Qwen3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 32000, (1, 16))

    @torch.no_grad()
    def run():
        cache = DynamicCache(config=model.config)
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return run


class NoOp(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def modes(tracer_mod, consumer=None, keep=None):
    """``enter(mode name)``: a mode entered (None for plain), its tracer's batches going to ``consumer``; every op's
    output is appended to the list ``keep`` if one is given (no address is then reused)."""
    live: list = []  # data pointers of outputs announced, freed 8 ops later

    class Announcing:
        """An op overload that announces its fresh output's storage as an allocation, as CUDA's allocator does."""

        __slots__ = ("func", "run")

        def __init__(self, func):
            self.func = func
            self.run = func  # what the tracer would call for the op itself (set with its plan)

        def __call__(self, *a, **k):
            out = self.run(*a, **k)
            if keep is not None:
                keep.append(out)
            if isinstance(out, torch.Tensor):
                p = out.untyped_storage().data_ptr()
                if p not in live:
                    live.append(p)
                    gt.MemoryAllocationCallbacks.fire_callbacks(p)
            return out

        def __getattr__(self, name):
            return getattr(self.func, name)

    wrappers: dict = {}

    class Traced(tracer_mod._Mode):
        """The tracer's mode (its C tracer too, where built), behind a function that frees between ops."""

        def __init__(self, tracer):
            super().__init__(tracer)
            inner = self.__dict__.get("__torch_dispatch__") or super().__torch_dispatch__

            def dispatch(func, types, args=(), kwargs=None):
                w = wrappers.get(func)
                if w is None:
                    w = wrappers[func] = Announcing(func)
                if len(live) > 8:
                    gt.MemoryDeallocationCallbacks.fire_callbacks(live.pop(0))  # a tensor dropped between ops
                return inner(w, types, args, kwargs)
            dispatch.__self__ = self  # (PyTorch checks that a mode's __torch_dispatch__ is bound)
            self.__torch_dispatch__ = dispatch

    plan = getattr(tracer_mod, "_unwrapped_plan", None) or tracer_mod.TorchTracer._plan
    tracer_mod._unwrapped_plan = plan  # (modes() may be called again for the same module)

    def plan_of_wrapped(self, func):  # filed under the wrapper, by identity (now) or by the object (older revs)
        p = self.plans[func] = self.plans[id(func)] = plan(self, func.func)
        if hasattr(p, "call"):  # the plan calls the op directly: through the announcing wrapper instead
            func.run, p.call = p.call, func
            if hasattr(p, "fast"):
                p.fast = (p.fast[0], func) + p.fast[2:]
        return p
    tracer_mod.TorchTracer._plan = plan_of_wrapped
    tracer_mod._GpuTrace.install()

    def enter(name):
        if name == "plain":
            return None
        if name == "floor":
            m = NoOp()
        else:
            os.environ["STREAMSAN_CORE"] = "python" if "python" in name else ""
            buf = EventBuffer([consumer or (lambda evs: None)])
            tr = tracer_mod.TorchTracer(buf, StreamRegistry(buf), StackTable())
            tr.running = tr.tracing = "inactive" not in name
            tracer_mod._GpuTrace.active = None if "nocb" in name else tr
            if "nostack" in name:
                tr.stacks.capture = lambda events, skip=1: 0
            m = Traced(tr)
        m.__enter__()
        return m
    return enter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", metavar="MODE", help="one decode under MODE with callgrind's instrumentation on")
    p.add_argument("--rev", help="the tracer of this git revision instead of the working tree's")
    p.add_argument("--runs", type=int, default=12)
    a = p.parse_args()
    torch.set_num_threads(1)
    enter = modes(load_tracer(a.rev))
    run = decode_loop()
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
