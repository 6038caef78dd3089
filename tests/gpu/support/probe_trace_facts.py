"""Print which PyTorch GPU trace callbacks (and which aten ops under a dispatch mode) each API fires.

Run on a CUDA machine: ``python tests/gpu/support/probe_trace_facts.py``. The tracer relies on these facts; re-run on
a new torch version. Not a test: it prints a table.
"""

import sys

import torch
import torch.cuda._gpu_trace as gt
from torch.utils._python_dispatch import TorchDispatchMode

log = []


def rec(name):
    return lambda *a: log.append((name,) + tuple(hex(x) if isinstance(x, int) and x > 4096 else x for x in a))


torch._C._activate_gpu_trace()
gt.register_callback_for_event_creation(rec("event_creation"))
gt.register_callback_for_event_deletion(rec("event_deletion"))
gt.register_callback_for_event_record(rec("event_record"))
gt.register_callback_for_event_wait(rec("event_wait"))
gt.register_callback_for_memory_allocation(rec("alloc"))
gt.register_callback_for_memory_deallocation(rec("free"))
gt.register_callback_for_stream_creation(rec("stream_creation"))
gt.register_callback_for_device_synchronization(rec("device_sync"))
gt.register_callback_for_stream_synchronization(rec("stream_sync"))
gt.register_callback_for_event_synchronization(rec("event_sync"))


class Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        log.append(("op", str(func)))
        return func(*args, **(kwargs or {}))


def probe(title, fn, mode=True):
    log.clear()
    try:
        if mode:
            with Ops():
                fn()
        else:
            fn()
        res = log[:]
    except Exception as e:
        res = log[:] + [("EXCEPTION", repr(e))]
    print(f"## {title}")
    for r in res:
        print("   ", *r)


torch.cuda.init()
x = torch.ones(1024, device="cuda")
s = torch.cuda.Stream()
ts = torch.Stream(device="cuda")
print("torch", torch.__version__, "default handle", torch.cuda.current_stream().cuda_stream,
      "side", hex(s.cuda_stream), "torch.Stream", ts, type(ts).__mro__)
print("raw current", torch._C._cuda_getCurrentRawStream(0))
print("torch.Stream attrs", [a for a in dir(ts) if not a.startswith("__")])
print("torch.cuda.Stream mro", torch.cuda.Stream.__mro__)
pinned = torch.empty(1024).pin_memory()
pageable = torch.empty(1024)

probe("empty cuda", lambda: torch.empty(10, device="cuda"))
probe("zeros cuda", lambda: torch.zeros(10, device="cuda"))
probe("x * 2", lambda: x * 2)
probe("x.add_(1)", lambda: x.add_(1))
probe("fill_", lambda: x.fill_(3))
probe("torch.cat", lambda: torch.cat([x, x]))
probe("x[::2].clone()", lambda: x[::2].clone())
probe("item", lambda: x[0].item())
probe("cpu()", lambda: x.cpu())
probe("tolist", lambda: x[:4].tolist())
probe("to cpu non_blocking", lambda: x.to("cpu", non_blocking=True))
probe("pin_memory()", lambda: torch.empty(16).pin_memory())
probe("empty pin_memory=True", lambda: torch.empty(16, pin_memory=True))
probe("pinned.copy_(x, non_blocking=True) D2H pinned", lambda: pinned.copy_(x, non_blocking=True))
probe("pageable.copy_(x, non_blocking=True) D2H pageable", lambda: pageable.copy_(x, non_blocking=True))
probe("x.copy_(pinned, non_blocking=True) H2D pinned", lambda: x.copy_(pinned, non_blocking=True))
probe("x.copy_(pageable, non_blocking=True) H2D pageable", lambda: x.copy_(pageable, non_blocking=True))
probe("pinned.to(cuda, non_blocking=True)", lambda: pinned.to("cuda", non_blocking=True))
probe("pageable.to(cuda)", lambda: pageable.to("cuda"))
probe("x.copy_(pinned) blocking H2D", lambda: x.copy_(pinned))
probe("pinned.add_(1) CPU op", lambda: pinned.add_(1))
probe("pinned.copy_(pageable) CPU copy", lambda: pinned.copy_(pageable))
probe("record_stream", lambda: x.record_stream(s))
probe("record_stream torch.Stream", lambda: x.record_stream(ts))
probe("s.wait_stream(cur)", lambda: s.wait_stream(torch.cuda.current_stream()))
probe("ts.wait_stream(cur)", lambda: ts.wait_stream(torch.cuda.current_stream()))
probe("s.synchronize", lambda: s.synchronize())
probe("ts.synchronize", lambda: ts.synchronize())
probe("s.query", lambda: s.query())
probe("torch.cuda.synchronize", lambda: torch.cuda.synchronize())
ev = torch.cuda.Event()
probe("cuda.Event record", lambda: ev.record())
probe("cuda.Event wait(s)", lambda: ev.wait(s))
probe("cuda.Event synchronize", lambda: ev.synchronize())
probe("cuda.Event query", lambda: ev.query())
gev = torch.Event(device="cuda")
probe("torch.Event record", lambda: gev.record())
probe("torch.Event wait(ts)", lambda: gev.wait(ts))
probe("torch.Event synchronize", lambda: gev.synchronize())
probe("torch.Event query", lambda: gev.query())
probe("s.record_event", lambda: s.record_event())


def ctx_cuda_stream():
    with torch.cuda.stream(s):
        log.append(("raw", hex(torch._C._cuda_getCurrentRawStream(0))))
        x.add_(1)


def ctx_stream_obj():
    with s:
        log.append(("raw", hex(torch._C._cuda_getCurrentRawStream(0))))


def ctx_torch_stream():
    with ts:
        log.append(("raw", hex(torch._C._cuda_getCurrentRawStream(0))))
        x.add_(1)


probe("with torch.cuda.stream(s)", ctx_cuda_stream)
probe("with s", ctx_stream_obj)
probe("with torch.Stream", ctx_torch_stream)
probe("torch.Stream cuda_stream attr", lambda: log.append(("ts.cuda_stream", getattr(ts, "cuda_stream", None),
                                                            "stream_id", ts.stream_id)))
probe("del tensor", lambda: torch.empty(1 << 20, device="cuda").add_(1))
try:
    import cupy

    probe("cupy.cuda.Stream() default flags",
          lambda: log.append(("cupy", cupy.cuda.Stream().ptr, cupy.cuda.runtime.streamGetFlags(cupy.cuda.Stream().ptr))))
except Exception as e:  # noqa
    print("cupy:", e)
print("done", file=sys.stderr)
