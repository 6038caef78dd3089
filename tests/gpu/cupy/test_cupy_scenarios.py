"""Real CuPy (and CuPy + torch) programs on a GPU, each with the exact findings streamsan must report (or none).

Same table-driven style as test_torch_scenarios.py: EXPECTED maps each scenario to (kind, previous stream role,
previous op, current stream role, current op) tuples. CuPy side streams are named with streamsan.name_stream;
"default" is the legacy default stream (CuPy's Stream.null, torch's default stream). Skipped without CUDA, torch
(the shared conftest needs it) or CuPy.
"""

import numpy

import torch

import streamsan
from tests.gpu.support.scenario_kit import cupy_streams as streams
from tests.gpu.support.scenario_kit import need_cupy, scenario_tests
from tests.support.fixtures import expected

cupy, cupyx = need_cupy()

N = 1 << 16
F32 = numpy.float32


def filled(value=1.0, n=N):
    x = cupy.empty(n, dtype=F32)
    x.fill(value)  # on the current stream
    return x


def device_sync():
    cupy.cuda.Device().synchronize()


COPY_KERNEL = r'''
extern "C" __global__ void {name}(const float* x, float* y, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}}
'''


def copy_kernel(name):
    return cupy.RawKernel(COPY_KERNEL.format(name=name), name)


# ------------------------------------------------------------------------------------ races (CuPy only)
def nonblocking_streams_race():
    s1, s2 = streams("side", "side2")
    x = cupy.empty(N, dtype=F32)
    with s1:
        x.fill(1.0)
    with s2:
        x.fill(2.0)
    device_sync()


def nonblocking_stream_vs_null_race():
    (s,) = streams("side")
    x = filled()  # the null (legacy default) stream
    with s:
        x.fill(2.0)  # a non-blocking stream is not ordered after the null stream
    device_sync()


def raw_kernel_unannotated_false_positive():
    k = copy_kernel("streamsan_copy_plain")
    s1, s2 = streams("side", "side2")
    x = filled()
    e = cupy.cuda.Stream.null.record()
    s1.wait_event(e)
    s2.wait_event(e)
    y1 = cupy.empty(N, dtype=F32)
    y2 = cupy.empty(N, dtype=F32)
    with s1:
        k((N // 256,), (256,), (x, y1, numpy.int32(N)))
    with s2:
        k((N // 256,), (256,), (x, y2, numpy.int32(N)))  # both only read x, but nothing says so
    device_sync()


def elementwise_kernel_race():
    k = cupy.ElementwiseKernel("T x", "T y", "y = x * 2", "streamsan_double")
    (s,) = streams("side")
    x = filled()
    y = cupy.empty(N, dtype=F32)
    with s:
        k(x, y)  # reads x before the null stream's fill is known done
    device_sync()


def reduction_kernel_race():
    k = cupy.ReductionKernel("T x", "T y", "x", "a + b", "y = a", "0", "streamsan_sum")
    (s,) = streams("side")
    x = filled()
    with s:
        total = k(x)
    device_sync()
    del total


def ufunc_out_race():
    (s,) = streams("side")
    x = filled()
    y = cupy.empty(N, dtype=F32)
    with s:
        cupy.add(x, 1.0, out=y)
    device_sync()


def matmul_race():
    (s,) = streams("side")
    a = cupy.empty((256, 256), dtype=F32)
    a.fill(1.0)
    with s:
        c = a @ a  # cuBLAS on the side stream reads a
    device_sync()
    del c


def pinned_host_read_after_async_d2h():
    x = filled()
    p = cupyx.empty_pinned(N, dtype=F32)
    x.get(out=p, blocking=False)  # async device-to-host copy on the null stream
    p.sum()  # the host reads p before anything says the copy is done
    device_sync()


def pinned_host_write_during_h2d():
    p = cupyx.zeros_pinned(N, dtype=F32)
    x = cupy.empty(N, dtype=F32)
    x.set(p)  # async host-to-device copy from pinned memory
    p[:] = 2.0  # the host overwrites p while the copy may still read it
    device_sync()


def memcpy_async_d2h_then_host_read():
    (s,) = streams("side")
    x = filled()
    p = cupyx.empty_pinned(N, dtype=F32)
    s.wait_event(cupy.cuda.Stream.null.record())
    cupy.cuda.runtime.memcpyAsync(p.ctypes.data, x.data.ptr, x.nbytes, cupy.cuda.runtime.memcpyDeviceToHost,
                                  s.ptr)
    p.sum()
    device_sync()


def pool_reuse_across_streams():
    (s,) = streams("side")
    with s:
        x = filled()  # allocated on side: its block goes back to side's free list
    cupy.cuda.Stream.null.wait_event(s.record())
    y = x * 2  # used on the null stream
    del x  # freed while the null stream may still read it
    with s:
        z = filled(5.0)  # side may get x's block back at once
    device_sync()
    del y, z


# ------------------------------------------------------------------------------------ races (torch + CuPy)
def torch_and_cupy_streams_race():
    t = torch.empty(N, device="cuda")
    t.fill_(1.0)  # torch default stream
    ts = torch.cuda.Stream()
    streamsan.name_stream(ts, "torch_side")
    (cs,) = streams("cupy_side")
    x = cupy.asarray(t)  # the same memory (no copy, no synchronization)
    cs.wait_event(cupy.cuda.Stream.null.record())
    with cs:
        x *= 2  # CuPy writes on its stream
    ts.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ts):
        t.add_(1.0)  # torch writes on its stream without waiting for cupy_side
    torch.cuda.synchronize()


def torch_fill_then_cupy_asarray_race():
    t = torch.empty(N, device="cuda")
    t.fill_(1.0)
    (cs,) = streams("cupy_side")
    with cs:
        x = cupy.asarray(t)  # no stream hand-off (unlike from_dlpack)
        x *= 2
    device_sync()


# ------------------------------------------------------------------------------------ clean
def nonblocking_streams_ordered_by_event():
    s1, s2 = streams("side", "side2")
    x = cupy.empty(N, dtype=F32)
    with s1:
        x.fill(1.0)
    e = cupy.cuda.Event()
    e.record(s1)
    s2.wait_event(e)
    with s2:
        x *= 2
    device_sync()


def blocking_stream_and_null_clean():
    (s,) = streams("side", non_blocking=False)  # CuPy's default: a blocking stream
    x = filled()  # null stream
    with s:
        x *= 2  # implicitly after the null stream's work
    x += 1  # and the null stream implicitly after s
    device_sync()


def raw_kernel_annotated_clean():
    k = copy_kernel("streamsan_copy_annotated")
    streamsan.cupy_access(k, reads=("x",), writes=("y",))
    s1, s2 = streams("side", "side2")
    x = filled()
    e = cupy.cuda.Stream.null.record()
    s1.wait_event(e)
    s2.wait_event(e)
    y1 = cupy.empty(N, dtype=F32)
    y2 = cupy.empty(N, dtype=F32)
    with s1:
        k((N // 256,), (256,), (x, y1, numpy.int32(N)))
    with s2:
        k((N // 256,), (256,), (x, y2, numpy.int32(N)))
    device_sync()


def raw_module_annotated_clean():
    mod = cupy.RawModule(code=COPY_KERNEL.format(name="streamsan_copy_module"))
    k = mod.get_function("streamsan_copy_module")
    streamsan.cupy_access(k, reads=(0,), writes=(1,))
    s1, s2 = streams("side", "side2")
    x = filled()
    e = cupy.cuda.Stream.null.record()
    s1.wait_event(e)
    s2.wait_event(e)
    y1 = cupy.empty(N, dtype=F32)
    y2 = cupy.empty(N, dtype=F32)
    k((N // 256,), (256,), (x, y1, numpy.int32(N)), stream=s1)
    k((N // 256,), (256,), (x, y2, numpy.int32(N)), stream=s2)
    device_sync()


def pinned_read_after_sync(kind):
    def run():
        x = filled()
        p = cupyx.empty_pinned(N, dtype=F32)
        x.get(out=p, blocking=kind == "blocking_get")
        if kind == "stream":
            cupy.cuda.get_current_stream().synchronize()
        elif kind == "device":
            cupy.cuda.Device().synchronize()
        elif kind == "runtime_device":
            cupy.cuda.runtime.deviceSynchronize()
        elif kind == "event":
            e = cupy.cuda.Event()
            e.record()
            e.synchronize()
        elif kind == "event_done":
            e = cupy.cuda.Event()
            e.record()
            while not e.done:
                pass
        elif kind == "stream_done":
            while not cupy.cuda.get_current_stream().done:
                pass
        p.sum()
        p[0] = 3.0
    run.__name__ = f"pinned_read_after_sync_{kind}"
    return run


def memcpy_async_d2h_synchronized():
    (s,) = streams("side")
    x = filled()
    p = cupyx.empty_pinned(N, dtype=F32)
    s.wait_event(cupy.cuda.Stream.null.record())
    cupy.cuda.runtime.memcpyAsync(p.ctypes.data, x.data.ptr, x.nbytes, cupy.cuda.runtime.memcpyDeviceToHost,
                                  s.ptr)
    s.synchronize()
    p.sum()


def pool_reuse_after_wait():
    (s,) = streams("side")
    with s:
        x = filled()
    cupy.cuda.Stream.null.wait_event(s.record())
    y = x * 2
    del x
    s.wait_event(cupy.cuda.Stream.null.record())  # side waits for the null stream before allocating again
    with s:
        z = filled(5.0)
    device_sync()
    del y, z


def get_and_asnumpy_blocking():
    (s,) = streams("side")
    x = filled()
    s.wait_event(cupy.cuda.Stream.null.record())
    with s:
        h = x.get()  # blocking (pageable): the host waits for side
        h2 = cupy.asnumpy(x * 2)
    x.fill(3.0)  # ordered: the null stream joins the host, which waited for side
    device_sync()
    del h, h2


def torch_and_cupy_external_stream_handoff():
    t = torch.empty(N, device="cuda")
    t.fill_(1.0)
    ts = torch.cuda.Stream()
    streamsan.name_stream(ts, "torch_side")
    (cs,) = streams("cupy_side")
    x = cupy.asarray(t)
    cs.wait_event(cupy.cuda.Stream.null.record())
    with cs:
        x *= 2
    ts.wait_stream(torch.cuda.ExternalStream(cs.ptr))  # the same agent as cs
    with torch.cuda.stream(ts):
        t.add_(1.0)
    torch.cuda.synchronize()


def torch_to_cupy_from_dlpack_handoff():
    t = torch.empty(N, device="cuda")
    t.fill_(1.0)  # torch default stream
    (cs,) = streams("cupy_side")
    with cs:
        x = cupy.from_dlpack(t)  # t.__dlpack__(stream=cs.ptr): cs waits for torch's current stream
        x *= 2
    device_sync()


def cupy_to_torch_from_dlpack_handoff():
    ts = torch.cuda.Stream()
    streamsan.name_stream(ts, "torch_side")
    x = filled()  # null stream
    with torch.cuda.stream(ts):
        t = torch.from_dlpack(x)  # x.__dlpack__(stream=ts): ts waits for CuPy's current stream
        t.mul_(2.0)
    torch.cuda.synchronize()


SCENARIOS = [
    nonblocking_streams_race,
    nonblocking_stream_vs_null_race,
    raw_kernel_unannotated_false_positive,
    elementwise_kernel_race,
    reduction_kernel_race,
    ufunc_out_race,
    matmul_race,
    pinned_host_read_after_async_d2h,
    pinned_host_write_during_h2d,
    memcpy_async_d2h_then_host_read,
    pool_reuse_across_streams,
    torch_and_cupy_streams_race,
    torch_fill_then_cupy_asarray_race,
    nonblocking_streams_ordered_by_event,
    blocking_stream_and_null_clean,
    raw_kernel_annotated_clean,
    raw_module_annotated_clean,
    pinned_read_after_sync("blocking_get"),
    pinned_read_after_sync("stream"),
    pinned_read_after_sync("device"),
    pinned_read_after_sync("runtime_device"),
    pinned_read_after_sync("event"),
    pinned_read_after_sync("event_done"),
    pinned_read_after_sync("stream_done"),
    memcpy_async_d2h_synchronized,
    pool_reuse_after_wait,
    get_and_asnumpy_blocking,
    torch_and_cupy_external_stream_handoff,
    torch_to_cupy_from_dlpack_handoff,
    cupy_to_torch_from_dlpack_handoff,
]
# (kind, previous role, previous op, current role, current op) per scenario; shared with the CPU replay test of
# the traces these scenarios recorded (tests/replay/test_replay_fixtures.py).
EXPECTED = expected("cupy_scenarios")


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED, tracer="cupy")
