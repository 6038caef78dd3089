"""Pinned host buffers accessed where no traced call shows it, each as a small buggy program and its fix.

A host buffer in pinned memory is refilled step after step and copied to the GPU asynchronously. Each buggy program
refills the buffer while the stream may still be copying the previous step's bytes (the stream is kept busy first,
so the copy really is pending); its fix synchronizes first, or refills a different buffer. Through a NumPy view made
with ``Tensor.numpy()`` when the buffer was (vLLM's ``CpuGpuBuffer.np``) each write is seen when it happens. Through
memory streamsan cannot watch call by call (``ctypes.memmove``: a C++ scheduler filling host memory; a plain NumPy
array over CuPy's pinned memory) a write is found by the bytes it changed, at the next copy out of the same place
(``streamsan.tracers.staging``), and reported as the host's "refill outside traced calls" at that copy. The last
pair reads a device-to-host result through a NumPy view that outlives a later synchronization: the view reports
each read when it happens.

EXPECTED maps each scenario to its (kind, previous stream role, previous op, current stream role, current op)
tuples; fixed programs expect ``[]``. Stream roles: "default" (the current stream), "host", and the side streams
each program names ("h2d").
"""

import ctypes

import numpy
import pytest
import torch

from streamsan.tracers.staging import WRITE_SEEN
from tests.gpu.support.scenario_kit import scenario_tests, streams

SLOTS = 64
STEPS = 3
BUSY = 2_000_000  # GPU cycles of torch.cuda._sleep before each copy: the copy is still pending when the host goes on


def _busy():
    torch.cuda._sleep(BUSY)


# ------------------------------------------------------------------ vLLM CpuGpuBuffer, query start locations
def _query_start_loc_steps(shadows):
    """vLLM's ``CpuGpuBuffer``: ``cpu`` (pinned), ``np`` (a NumPy view of it, made with it) and ``gpu``;
    ``copy_to_gpu(n)`` is ``gpu[:n].copy_(cpu[:n], non_blocking=True)``. The model runner writes the step's
    query start locations through ``np``, copies them and runs the step. ``shadows``: copy out of rotating pinned
    shadow buffers, each reused only after the event of its previous copy (the double-buffered fix)."""
    cpu = torch.zeros(SLOTS, dtype=torch.int32, pin_memory=True)
    np_view = cpu.numpy()
    gpu = torch.zeros(SLOTS, dtype=torch.int32, device="cuda")
    ring = [(torch.zeros(SLOTS, dtype=torch.int32, pin_memory=True), torch.cuda.Event()) for _ in range(shadows)]
    positions = torch.arange(4096, device="cuda")
    for step in range(STEPS):
        num_reqs = 4 + step
        np_view[0] = 0
        np_view[1:num_reqs + 1] = numpy.cumsum(numpy.arange(1, num_reqs + 1) * (step + 1))
        _busy()
        if ring:
            shadow, done = ring[step % shadows]
            done.synchronize()  # the copy that last read this shadow is done
            shadow[:num_reqs + 1].copy_(cpu[:num_reqs + 1])
            gpu[:num_reqs + 1].copy_(shadow[:num_reqs + 1], non_blocking=True)
            done.record()
        else:
            gpu[:num_reqs + 1].copy_(cpu[:num_reqs + 1], non_blocking=True)
        positions.index_select(0, gpu[:num_reqs + 1].long()).sum()  # the step's attention metadata
    torch.cuda.synchronize()


def vllm_query_start_loc_refilled_before_copy():
    """Models vllm-project/vllm-ascend#12071 (the same ``CpuGpuBuffer`` as vLLM's model runner): under asynchronous
    scheduling the query start locations of the next step were written into ``CpuGpuBuffer.np`` before the
    non-blocking copy of the previous step had run, so the device read overwritten indices (out-of-bounds logits
    indices, torn attention metadata)."""
    _query_start_loc_steps(shadows=0)


def vllm_query_start_loc_double_buffered():
    """The fix of vllm-project/vllm-ascend#12191: copy out of two pinned shadow buffers in turn, each reused only
    after ``synchronize()`` on the event of its previous copy; ``cpu`` / ``np`` are never read by the stream."""
    _query_start_loc_steps(shadows=2)


def vllm_query_start_loc_snapshot():
    """The fix of vllm-project/vllm-ascend#12079 (``copy_snapshot_to_gpu``): each step copies out of a fresh pinned
    clone of the buffer; PyTorch's pinned allocator hands a freed clone's block out again only after its copy."""
    cpu = torch.zeros(SLOTS, dtype=torch.int32, pin_memory=True)
    np_view = cpu.numpy()
    gpu = torch.zeros(SLOTS, dtype=torch.int32, device="cuda")
    for step in range(STEPS):
        num_reqs = 4 + step
        np_view[1:num_reqs + 1] = numpy.cumsum(numpy.arange(1, num_reqs + 1) * (step + 1))
        _busy()
        snapshot = cpu[:num_reqs + 1].clone().pin_memory()
        gpu[:num_reqs + 1].copy_(snapshot, non_blocking=True)
        del snapshot
    torch.cuda.synchronize()


# ------------------------------------------------------------------ an overlapping scheduler's sampling buffer
def _sampling_steps(fresh_buffer):
    """A scheduler in native code fills the batch's sampling temperatures in pinned host memory (here
    ``ctypes.memmove``), launches the copy to the GPU and the forward pass, and goes on to the next batch."""
    batch = 16
    host = torch.empty(batch, dtype=torch.float32, pin_memory=True)
    temps = torch.empty(batch, dtype=torch.float32, device="cuda")
    logits = torch.randn(batch, 1024, device="cuda")
    for step in range(STEPS):
        if fresh_buffer:
            host = torch.empty(batch, dtype=torch.float32, pin_memory=True)
        values = numpy.full(batch, 0.5 + step, dtype=numpy.float32)
        ctypes.memmove(host.data_ptr(), values.ctypes.data, values.nbytes)  # fill host
        _busy()
        temps.copy_(host, non_blocking=True)  # h2d launch
        logits.div(temps[:, None]).softmax(-1)  # fwd launch
    torch.cuda.synchronize()


def tokenspeed_overlap_fill_host_races_h2d():
    """Models lightseekorg/tokenspeed#376: with the overlapping scheduler, "fill host" for batch N+1 is not fenced
    by the CUDA stream, so it can run before the H2D copy of batch N has executed (fill host -> h2d launch -> fwd
    launch -> [fill host] while [h2d exec])."""
    _sampling_steps(fresh_buffer=False)


def tokenspeed_fill_host_fresh_buffer():
    """The fix of lightseekorg/tokenspeed#376: the host buffer is created for each batch, so each fill writes a
    buffer no pending copy reads."""
    _sampling_steps(fresh_buffer=True)


# ------------------------------------------------------------------ CuPy: a plain NumPy array over pinned memory
def _cupy_staging_steps(synchronize):
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("needs CuPy with a CUDA GPU")
    (h2d,) = streams("h2d", make=lambda: cupy.cuda.Stream(non_blocking=True))
    n = 1 << 12
    host = numpy.frombuffer(cupy.cuda.alloc_pinned_memory(n * 4), numpy.float32, n)
    dev = cupy.empty(n, dtype=numpy.float32)
    for step in range(STEPS):
        if synchronize:
            h2d.synchronize()  # the previous step's copy is done
        host[:] = step  # plain NumPy: not a traced call
        with h2d:
            dev.set(host, stream=h2d)
            dev *= 2
    h2d.synchronize()


def cupy_pinned_array_refilled_during_h2d():
    """Models the race kmaehashi pointed out in the review of cupy/cupy#5155: ``arr_gpu = cupy.array(arr_cpu)``
    from pinned memory starts an asynchronous copy, and ``arr_cpu[:] = 0`` right after it "may run during HtoD".
    Here the pinned array is a plain ``numpy.frombuffer(cupy.cuda.alloc_pinned_memory(...))`` refilled each step
    before the stream's previous ``set`` out of it is done."""
    _cupy_staging_steps(synchronize=False)


def cupy_pinned_array_refilled_after_sync():
    """The fix: synchronize the copying stream before refilling the buffer."""
    _cupy_staging_steps(synchronize=True)


# ------------------------------------------------------------------ a NumPy view of a pending D2H result
def _host_reads_result(synchronize):
    logits = torch.randn(SLOTS * 64, device="cuda")
    _busy()
    host = logits.to("cpu", non_blocking=True)  # pinned, filled by the stream later
    probs = host.numpy()
    if synchronize:
        torch.cuda.current_stream().synchronize()
    token = int(probs.argmax())  # the host reads the result
    torch.cuda.synchronize()  # (the view is still alive here)
    del probs
    return token


def deepspeed_reads_async_copy_result_early():
    """Models the question raised in the review of deepspeedai/DeepSpeed#501 about a value copied to the host with
    ``non_blocking=True``: "can we guarantee that the value ... is the value of async_buff after the copy_ and not
    before?" Here the host takes the argmax through a NumPy view of the pinned result before synchronizing; the
    view is still alive at the later ``torch.cuda.synchronize()``."""
    _host_reads_result(synchronize=False)


def deepspeed_reads_async_copy_result_after_sync():
    """The fix: synchronize the stream before the host reads the copied result."""
    _host_reads_result(synchronize=True)


SCENARIOS = [
    vllm_query_start_loc_refilled_before_copy, vllm_query_start_loc_double_buffered, vllm_query_start_loc_snapshot,
    tokenspeed_overlap_fill_host_races_h2d, tokenspeed_fill_host_fresh_buffer,
    cupy_pinned_array_refilled_during_h2d, cupy_pinned_array_refilled_after_sync,
    deepspeed_reads_async_copy_result_early, deepspeed_reads_async_copy_result_after_sync,
]

EXPECTED = {
    # one finding per line that writes through the view (``np_view[0] = 0`` and the cumulative sums; count 2 each:
    # steps 1 and 2)
    "vllm_query_start_loc_refilled_before_copy": [
        ("host-device", "default", "aten::copy_", "host", "numpy.ndarray.__setitem__"),
        ("host-device", "default", "aten::copy_", "host", "numpy.ndarray.__setitem__"),
    ],
    "vllm_query_start_loc_double_buffered": [],
    "vllm_query_start_loc_snapshot": [],
    "tokenspeed_overlap_fill_host_races_h2d": [
        ("host-device", "default", "aten::copy_", "host", WRITE_SEEN),
    ],
    "tokenspeed_fill_host_fresh_buffer": [],
    "cupy_pinned_array_refilled_during_h2d": [
        ("host-device", "h2d", "cupy.ndarray.set", "host", WRITE_SEEN),
    ],
    "cupy_pinned_array_refilled_after_sync": [],
    "deepspeed_reads_async_copy_result_early": [
        ("host-device", "default", "aten::_to_copy", "host", "numpy.ndarray.argmax"),
    ],
    "deepspeed_reads_async_copy_result_after_sync": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)


def test_the_writes_through_the_view_name_their_elements(san):
    """Each finding's memory is what its write shares with the previous copy's read: in step 1, entry 0 (written
    with the value it had: still a race) and entries 1..4 of the 5 that step 0 copied; found again in step 2."""
    session, got = san(vllm_query_start_loc_refilled_before_copy)
    assert sorted((f.count, f.lo - f.block.start, f.hi - f.lo) for f in session.findings) == [(2, 0, 4), (2, 4, 16)]


def test_a_refill_no_traced_call_shows_names_the_changed_elements(san):
    """A write found by the bytes it changed names those that the previous copy read: ``ctypes.memmove`` refills
    all 16 temperatures each step with a new value; found at the copies of steps 1 and 2."""
    session, got = san(tokenspeed_overlap_fill_host_races_h2d)
    (f,) = session.findings
    assert f.count == 2
    assert (f.lo - f.block.start, f.hi - f.lo) == (0, 16 * 4)
