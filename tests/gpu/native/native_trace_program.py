"""Run by tests/gpu/native/test_native_observer_gpu.py in a process of its own (PyTorch's GPU-trace slot, once taken, is
the process's for good): ``python native_trace_program.py native-first|python-first``. Prints one JSON object.

native-first: installs the observer in the slot, runs allocations, frees, event record / wait / synchronize,
stream and device synchronizations with ops between them, then takes PyTorch's Python path
(``torch._C._activate_gpu_trace()``) and checks the slot is still the observer's; then forwards the events to a
Python callback. python-first: the Python path first, then the observer's install must say the slot is taken.
"""

import json
import sys
import threading

import torch

from streamsan.native import observer, records


def native_first() -> dict:
    owned, reason = observer.install_gpu_trace()
    out = {"owned": owned, "reason": reason}
    if not owned:
        return out
    dec = observer.decoder()
    side = torch.cuda.Stream()
    observer.drain()
    observer.start()
    x = torch.empty(1 << 20, device="cuda")  # a fresh block: allocated inside the op
    x.fill_(1.0)
    done = torch.cuda.Event()
    done.record()  # (created at its first record)
    side.wait_event(done)
    with torch.cuda.stream(side):
        y = x * 2  # on the side stream
    y.record_stream(side)
    ev = torch.cuda.Event()
    ev.record(side)
    ev.synchronize()
    side.synchronize()
    del x  # freed to the caching allocator: a free
    torch.cuda.synchronize()
    del ev  # (an event's deletion)
    observer.stop()
    got, events = dec.decode(observer.drain())
    out["records"] = [(r.seq, r.end, r.thread, r.name, r.stream) for r in got]
    out["events"] = [(e.seq, e.thread, e.kind, e.device_index, e.a, e.b) for e in events]
    out["main_thread"] = threading.get_ident()
    out["current_stream"] = torch.cuda.current_stream().stream_id
    out["side_stream"] = side.stream_id
    out["side_handle"] = side.cuda_stream
    out["default_handle"] = torch.cuda.current_stream().cuda_stream
    out["done_event"] = done.cuda_event

    torch._C._activate_gpu_trace()  # the Python path, after: the slot stays the observer's
    out["owned_after_python_path"] = observer.owns_gpu_trace()

    seen = []
    import torch.cuda._gpu_trace as gpu_trace

    gpu_trace.register_callback_for_memory_allocation(seen.append)
    observer.forward_gpu_trace(gpu_trace)
    observer.start()
    z = torch.empty(3 << 20, device="cuda")
    observer.stop()
    observer.forward_gpu_trace(None)
    _, events = dec.decode(observer.drain())
    out["forwarded"] = seen
    out["forward_native"] = [e.a for e in events if e.kind == records.ALLOC]
    del z
    return out


def python_first() -> dict:
    torch._C._activate_gpu_trace()
    owned, reason = observer.install_gpu_trace()
    return {"owned": owned, "reason": reason, "owns": observer.owns_gpu_trace()}


if __name__ == "__main__":
    module, why = observer.load()
    if module is None:
        print(json.dumps({"skip": why}))
        sys.exit(0)
    torch.cuda.init()
    result = native_first() if sys.argv[1] == "native-first" else python_first()
    print(json.dumps(result))
