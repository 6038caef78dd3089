"""Per-piece costs of the torch tracer's hot path on a GPU (microseconds per call), to aim optimizations.

    python bench/microcosts.py [--profile]
"""

import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamsan.session import Session  # noqa: E402
from streamsan.tracers.torch import device  # noqa: E402
from streamsan.tracers.torch.tensors import describe  # noqa: E402


def per_call(fn, n=20000):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


class NoOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


x = torch.ones(1024, 1024, device="cuda")
y = torch.ones(1024, 1024, device="cuda")
kv = torch.ones(1, 8, 64, 128, device="cuda", dtype=torch.bfloat16)  # one layer's keys in the offload decode
kv_host = kv.to("cpu", non_blocking=True)
s = Session(analyze=False).start()
tr = s.tracers["torch"]
rows = [
    ("x.add_(1) plain (traced)", lambda: x.add_(1)),
    ("x + y (traced, allocates)", lambda: x + y),
    ("kv.to(cpu, non_blocking) (traced)", lambda: kv.to("cpu", non_blocking=True)),
    ("kv_host.to(cuda, non_blocking) (traced)", lambda: kv_host.to("cuda", non_blocking=True)),
    ("torch.cat([kv, kv], -2) (traced)", lambda: torch.cat([kv, kv], -2)),
    ("kv_host.is_pinned()", lambda: kv_host.is_pinned()),
    ("range_in(x, 0)", lambda: tr.range_in(x, 0)),
    ("stacks.capture", lambda: tr.stacks.capture([], 0)),
    ("_cuda_getCurrentRawStream(0)", lambda: device.raw_stream(0)),
    ("x.untyped_storage()", lambda: x.untyped_storage()),
    ("describe(x)", lambda: describe(x)),
    ("x.is_contiguous()", lambda: x.is_contiguous()),
    ("x.data_ptr()", lambda: x.data_ptr()),
    ("x.nbytes", lambda: x.nbytes),
    ("x.get_device()", lambda: x.get_device()),
]
out = [(name, per_call(fn)) for name, fn in rows]
if "--profile" in sys.argv:  # where each traced op's time goes
    import cProfile
    import pstats

    for name, fn in rows[:5]:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3000):
            fn()
        prof.disable()
        print(f"== {name}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)
s.stop()
out.append(("x.add_(1) plain (untraced)", per_call(lambda: x.add_(1))))
out.append(("x + y (untraced)", per_call(lambda: x + y)))
out.append(("kv.to(cpu, non_blocking) (untraced)", per_call(lambda: kv.to("cpu", non_blocking=True))))
out.append(("kv_host.to(cuda, non_blocking) (untraced)", per_call(lambda: kv_host.to("cuda", non_blocking=True))))
out.append(("torch.cat([kv, kv], -2) (untraced)", per_call(lambda: torch.cat([kv, kv], -2))))
with NoOp():
    out.append(("x.add_(1) no-op mode", per_call(lambda: x.add_(1))))
    out.append(("x + y no-op mode", per_call(lambda: x + y)))
for name, us in out:
    print(f"{name:42s} {us:7.2f} us")
