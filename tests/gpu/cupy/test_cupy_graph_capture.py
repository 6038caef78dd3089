"""CuPy stream capture and integer kernel arguments as pointers: each racy program and its correct twin.

Captures are modelled on CuPy's own tests (tests/cupy_tests/cuda_tests/test_graph.py): a fork-join capture on two
non-blocking streams (the second joins by waiting on an event recorded on the first), and captures that fail. A
graph's launch is one op, ``cupy.cuda.Graph.launch``, on the launching stream; the nodes of a capture on several
streams are checked against each other. The pointer programs follow DeepEP's zero-copy read of a pinned torch
tensor by a CuPy ``RawKernel`` on PyTorch's current stream, through an integer argument. EXPECTED maps each
program to its (kind, previous stream role, previous op, current stream role, current op) tuples.
"""

import numpy
import pytest
import torch

from tests.gpu.support.scenario_kit import cupy_streams, need_cupy, scenario_tests

cupy, cupyx = need_cupy()

import streamsan  # noqa: E402

N = 1 << 16
BUSY = 2_000_000  # GPU cycles of torch.cuda._sleep: the kernel is still pending when the host goes on

WRITE_PINNED = r'''
extern "C" __global__ void streamsan_graph_write_pinned(unsigned long long dst_addr, const float* src, int n) {
    float* dst = (float*)dst_addr;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] * 2.0f;
}'''
ZERO_COPY_READ = r'''
extern "C" __global__ void streamsan_zero_copy_read(unsigned long long src_addr, float* dst, int n) {
    const float* src = (const float*)src_addr;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + 1.0f;
}'''


def _warm_up(a):
    """Compile and load the kernels the captures use, outside any capture."""
    b = a * 100
    c = b * 3
    c.sum()
    a ** 3
    cupy.cuda.Device().synchronize()


# ------------------------------------------------------------------ fork-join capture on two streams
def _fork_join(read_after_join):
    s1, s2 = cupy_streams("s1", "s2")
    e1, e2 = cupy.cuda.Event(), cupy.cuda.Event()
    a = cupy.ones(N, dtype=cupy.float32)
    _warm_up(a)
    with s1:
        s1.begin_capture()
        out1 = a * 100
        e1.record(s1)
        s2.wait_event(e1)  # s2 joins the capture
        with s2:
            out2 = out1 * 3
            e2.record(s2)
        if not read_after_join:
            total = out2.sum()  # s1 reads out2 before it waits for s2
        s1.wait_event(e2)
        if read_after_join:
            total = out2.sum()
        g = s1.end_capture()
    assert not s1.is_capturing() and not s2.is_capturing()
    g.launch()  # on the current stream: the null stream
    cupy.cuda.Stream.null.synchronize()
    if read_after_join:  # (read before the join, the sum takes out2 as the replay finds it: any value)
        assert float(total) == pytest.approx(300.0 * N)
    assert float(out2[0]) == 300.0


def cupy_graph_fork_join_read_before_join():
    _fork_join(read_after_join=False)


def cupy_graph_fork_join():
    _fork_join(read_after_join=True)


# ------------------------------------------------------------------ a launch and the host
def _launch_then_host_read(synced):
    """A captured raw kernel writes pinned host memory through an integer pointer (zero-copy); the host reads it
    after the launch, with or without synchronizing with the launching stream."""
    (s,) = cupy_streams("s")
    kern = streamsan.cupy_access(cupy.RawKernel(WRITE_PINNED, "streamsan_graph_write_pinned"),
                                 reads=("src",), writes=("dst_addr",))
    src = cupy.ones(N, dtype=cupy.float32)
    host = cupyx.empty_pinned(N, dtype=numpy.float32)
    args = (numpy.uint64(host.ctypes.data), src, numpy.int32(N))
    kern(((N + 255) // 256,), (256,), args)  # compiled and loaded before the capture
    cupy.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        kern(((N + 255) // 256,), (256,), args)
        g = s.end_capture()
    g.launch(stream=s)
    if synced:
        s.synchronize()
    total = host.sum()
    s.synchronize()
    assert float(host[0]) == 2.0 and total >= 0


def cupy_graph_launch_then_host_read_bug():
    _launch_then_host_read(synced=False)


def cupy_graph_launch_then_host_read_fixed():
    _launch_then_host_read(synced=True)


# ------------------------------------------------------------------ failed captures run nothing
def cupy_graph_failed_capture_runs_nothing():
    """CuPy's capture failure test: s2 joins s1's capture and computes there; its own end_capture fails and
    invalidates the capture, s1's end_capture fails too. Nothing captured ran: the null stream refilling the
    input and reading the output right after is no race."""
    s1, s2 = cupy_streams("s1", "s2")
    e2 = cupy.cuda.Event()
    a = cupy.ones(N, dtype=cupy.float32)
    _warm_up(a)
    with s1:
        s1.begin_capture()
        e2.record(s1)
        s2.wait_event(e2)
        with s2:
            b = a ** 3
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
            s2.end_capture()
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
            s1.end_capture()
    assert not s1.is_capturing() and not s2.is_capturing()
    a.fill(2.0)  # the null stream
    b.fill(0.0)
    s1.synchronize()
    s2.synchronize()
    cupy.cuda.Device().synchronize()


def cupy_graph_invalidated_by_a_synchronize():
    """An illegal synchronize during the capture invalidates it: end_capture fails, nothing captured ran."""
    (s,) = cupy_streams("s")
    a = cupy.ones(N, dtype=cupy.float32)
    _warm_up(a)
    with s:
        s.begin_capture()
        b = a * 100
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
            s.synchronize()
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
            s.end_capture()
    a.fill(5.0)  # the null stream
    b.fill(0.0)
    cupy.cuda.Device().synchronize()


# ------------------------------------------------------------------ integer pointers: DeepEP's zero-copy read
def _zero_copy_read(synced):
    """A CuPy RawKernel on PyTorch's current stream reads a pinned torch tensor through its address; the host
    drops the tensor and pins the next batch, which PyTorch's pinned allocator gives the same block (it recorded
    no event for the kernel) and fills while the kernel may still read it."""
    stream = torch.cuda.current_stream()
    ext = cupy.cuda.ExternalStream(stream.cuda_stream)
    kern = streamsan.cupy_access(cupy.RawKernel(ZERO_COPY_READ, "streamsan_zero_copy_read"),
                                 reads=("src_addr",), writes=("dst",))
    out = cupy.empty(N, dtype=cupy.float32)
    warm = torch.ones(N, dtype=torch.float32).pin_memory()
    kern(((N + 255) // 256,), (256,), (numpy.uint64(warm.data_ptr()), out, numpy.int32(N)), stream=ext)
    torch.cuda.synchronize()
    del warm

    batch = torch.ones(N, dtype=torch.float32).pin_memory()
    addr = batch.data_ptr()
    torch.cuda._sleep(BUSY)
    kern(((N + 255) // 256,), (256,), (numpy.uint64(addr), out, numpy.int32(N)), stream=ext)
    if synced:
        stream.synchronize()
    del batch
    nxt = torch.full((N,), 2.0).pin_memory()  # the host writes the next batch into the block
    assert nxt.data_ptr() == addr, "the pinned allocator gave the next batch another block"
    torch.cuda.synchronize()


def zero_copy_read_of_a_dropped_pinned_tensor_bug():
    _zero_copy_read(synced=False)


def zero_copy_read_of_a_dropped_pinned_tensor_fixed():
    _zero_copy_read(synced=True)


EXPECTED = {
    "cupy_graph_fork_join_read_before_join": [
        ("device-device", "s2", "cupy.ndarray.__mul__", "s1", "cupy.ndarray.sum")],
    "cupy_graph_fork_join": [],
    "cupy_graph_launch_then_host_read_bug": [
        ("host-device", "s", "cupy.cuda.Graph.launch", "host", "numpy.add.reduce")],
    "cupy_graph_launch_then_host_read_fixed": [],
    "cupy_graph_failed_capture_runs_nothing": [],
    "cupy_graph_invalidated_by_a_synchronize": [],
    "zero_copy_read_of_a_dropped_pinned_tensor_bug": [
        ("alloc-reuse", "default", "cupy.RawKernel:streamsan_zero_copy_read", "host", "aten::_pin_memory")],
    "zero_copy_read_of_a_dropped_pinned_tensor_fixed": [],
}
SCENARIOS = [globals()[name] for name in EXPECTED]

test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED, tracer="cupy")
