"""Triton kernels launched from Python on streams: each launch is one op, ``triton:<kernel>``, on the stream it runs
on (the current one), writing the arguments its stores reach and reading the others (streamsan.tracers.triton).

EXPECTED maps each scenario to its (kind, previous stream role, previous op, current stream role, current op)
tuples; clean programs expect ``[]``. Stream roles: "default" (the current stream) and the side streams each
program names ("side", "side2"). Skipped without Triton.
"""

import pytest
import torch

from streamsan.tracers.torch.patches.compile import COMPILE_NOTE
from tests.gpu.support.scenario_kit import scenario_tests, streams

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

N = 1 << 16
BLOCK = 1024
BUSY = 2_000_000


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)


@triton.jit
def _scatter_add_kernel(out_ptr, idx_ptr, src_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    idx = tl.load(idx_ptr + offs, mask=mask, other=0)
    tl.atomic_add(out_ptr + idx, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": 256}), triton.Config({"BLOCK": 1024})], key=["n"])
@triton.jit
def _tuned_scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)


def _scale(x, out):
    _scale_kernel[(triton.cdiv(N, BLOCK),)](x, out, N, BLOCK=BLOCK)


# ------------------------------------------------------------------ a kernel reading what another stream writes
def _produce_then_scale(waits):
    (side,) = streams("side")
    x = torch.empty(N, device="cuda")
    out = torch.empty(N, device="cuda")
    side.wait_stream(torch.cuda.current_stream())  # the allocations
    torch.cuda._sleep(BUSY)
    x.fill_(1.0)
    with torch.cuda.stream(side):
        if waits:
            side.wait_stream(torch.cuda.default_stream())  # the fill is done
        _scale(x, out)
    torch.cuda.current_stream().wait_stream(side)
    out.sum()
    torch.cuda.synchronize()


def triton_kernel_reads_input_before_producer():
    """A kernel on a side stream reads ``x`` while the default stream may still be filling it."""
    _produce_then_scale(waits=False)


def triton_kernel_waits_for_producer():
    _produce_then_scale(waits=True)


# ------------------------------------------------------------------ a kernel's output used on another stream
def _scale_then_use(waits):
    (side,) = streams("side")
    x = torch.ones(N, device="cuda")
    out = torch.empty(N, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY)
        _scale(x, out)
    if waits:
        torch.cuda.current_stream().wait_stream(side)
    out.sum()
    torch.cuda.synchronize()


def triton_output_used_without_wait():
    """The default stream sums the kernel's output while the side stream may still be writing it."""
    _scale_then_use(waits=False)


def triton_output_used_after_wait_stream():
    _scale_then_use(waits=True)


# ------------------------------------------------------------------ reads are reads
def triton_two_streams_read_shared_input():
    """Two side streams run the kernel on the same input at once: the input is only read by both."""
    side, side2 = streams("side", "side2")
    w = torch.ones(N, device="cuda")
    o1, o2 = torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    for s, o in ((side, o1), (side2, o2)):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _scale(w, o)
    for s in (side, side2):
        torch.cuda.current_stream().wait_stream(s)
    (o1 + o2).sum()
    torch.cuda.synchronize()


def _scatter(read_out):
    (side,) = streams("side")
    idx = torch.randint(0, 1024, (N,), device="cuda", dtype=torch.int32)
    src = torch.ones(N, device="cuda")
    out = torch.zeros(1024, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY)
        _scatter_add_kernel[(triton.cdiv(N, BLOCK),)](out, idx, src, N, BLOCK=BLOCK)
    (out if read_out else idx).sum()  # on the default stream, while the side stream may still run the kernel
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def triton_scatter_indices_read_concurrently():
    """The indices the kernel loads are only read: summing them on another stream at the same time is fine."""
    _scatter(read_out=False)


def triton_scatter_output_read_concurrently():
    """The atomics write ``out``: reading it on another stream without waiting races."""
    _scatter(read_out=True)


# ------------------------------------------------------------------ autotuning
def triton_autotuned_kernel_on_side_stream():
    """An autotuned kernel benchmarks its configurations (launches, events, synchronizations) on the side stream
    it is called on; properly ordered, nothing races."""
    (side,) = streams("side")
    x = torch.ones(N, device="cuda")
    out = torch.empty(N, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _tuned_scale_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK"]),)](x, out, N)
    torch.cuda.current_stream().wait_stream(side)
    out.sum()
    torch.cuda.synchronize()


SCENARIOS = [
    triton_kernel_reads_input_before_producer, triton_kernel_waits_for_producer,
    triton_output_used_without_wait, triton_output_used_after_wait_stream,
    triton_two_streams_read_shared_input,
    triton_scatter_indices_read_concurrently, triton_scatter_output_read_concurrently,
    triton_autotuned_kernel_on_side_stream,
]

EXPECTED = {
    "triton_kernel_reads_input_before_producer": [
        ("device-device", "default", "aten::fill_.Scalar", "side", "triton:_scale_kernel"),
    ],
    "triton_kernel_waits_for_producer": [],
    "triton_output_used_without_wait": [
        ("device-device", "side", "triton:_scale_kernel", "default", "aten::sum"),
    ],
    "triton_output_used_after_wait_stream": [],
    "triton_two_streams_read_shared_input": [],
    "triton_scatter_indices_read_concurrently": [],
    "triton_scatter_output_read_concurrently": [
        ("device-device", "side", "triton:_scatter_add_kernel", "default", "aten::sum"),
    ],
    "triton_autotuned_kernel_on_side_stream": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)


# ------------------------------------------------------------------ torch.compile'd code on a side stream
def _compiled_on_side_stream(waits_for_input, waits_for_output):
    (side,) = streams("side")
    f = torch.compile(lambda a: (a * 2).sin() + 1)
    f(torch.ones(N, device="cuda"))
    x = torch.empty(N, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY)
    x.fill_(1.0)
    with torch.cuda.stream(side):
        if waits_for_input:
            side.wait_stream(torch.cuda.default_stream())
        y = f(x)
    if waits_for_output:
        torch.cuda.current_stream().wait_stream(side)
    y.sum()
    torch.cuda.synchronize()


# Under streamsan's dispatch mode Dynamo does not compile (measured on an H200, torch 2.11): the compiled function
# runs eagerly, and its ops (mul, sin, add) are what races.
@pytest.mark.parametrize("waits_for_input, waits_for_output, expected", [
    (False, True, [("device-device", "default", "aten::fill_.Scalar", "side", "aten::mul.Tensor")]),
    (True, False, [("device-device", "side", "aten::add.Tensor", "default", "aten::sum")]),
    (True, True, []),
], ids=["input_not_ready", "output_used_early", "ordered"])
def test_compiled_code_on_a_side_stream(san, waits_for_input, waits_for_output, expected):
    session, got = san(_compiled_on_side_stream, waits_for_input, waits_for_output)
    assert got == expected
    assert COMPILE_NOTE in [text for _, text in session.analyzer.notes]
