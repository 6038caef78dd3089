"""Memory the caching allocator hands back to the driver, and events a captured graph records or waits for itself,
each as a small program that must stay clean and a twin with a real race (docs/semantics.md, "Memory handed back
to the driver" and "CUDA graph replays").

* ``torch.cuda.empty_cache()`` frees every segment no live block holds with ``cudaFree``, which waits for the whole
  device: a block read by another stream without ``record_stream`` and freed is no hazard once its segment went
  back, while a block in a segment split by a live one stays in its stream's free list (that race stays:
  test_field_allocator.py's ``empty_cache_is_no_fence``).
* A destroyed graph's private pool goes back at the next ``empty_cache``; while the graph's output is held, its
  segment stays, and reading the output on another stream without waiting for the replay is a race.
* The free-and-retry before an out-of-memory error (here under a per-process memory fraction) frees the default
  stream's cached segment for the side stream's allocation: the same bytes on another stream, after the driver.
* ``torch.cuda.Event(external=True)`` recorded inside a capture is recorded by each replay, where the captured
  copy before it has run; a captured wait on one makes each replay wait for the program's record of it.

Each program uses tensors of 32 MiB or more (a segment of their own, never split) except the graph-event ones.
"""

import gc
import inspect

import pytest
import torch

from tests.gpu.support.scenario_kit import scenario_tests, streams

BIG = 8 << 20  # float32 elements: 32 MiB, a segment of its own
N = 1 << 16
GIB = 1 << 30

external_events = "external" in inspect.signature(torch.cuda.Event.__new__).parameters  # (torch >= 2.8)


# ------------------------------------------------------------------ empty_cache between the free and the reuse
def _side_read_then_owner_reuse(release):
    (side,) = streams("side")
    torch.cuda.empty_cache()
    x = torch.empty(BIG, device="cuda")  # the default stream's, a segment of its own
    x.fill_(1.0)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2  # side reads x; no record_stream
    del x
    if release:
        torch.cuda.empty_cache()  # x's segment goes back: cudaFree waits for side's read
    z = torch.empty(BIG, device="cuda")  # the default stream allocates again (x's block, or a new segment)
    z.fill_(5.0)
    torch.cuda.synchronize()
    del y, z


def side_read_then_owner_reuse_without_record_stream():
    """x read on side, freed with no ``record_stream``; the default stream allocates again: missing record_stream."""
    _side_read_then_owner_reuse(release=False)


def side_read_then_empty_cache_then_owner_reuse():
    """The same with ``torch.cuda.empty_cache()`` after the free: x's segment went back to the driver, which waited
    for every access of it, so nothing of side's read is pending when the default stream allocates again."""
    _side_read_then_owner_reuse(release=True)


def empty_cache_hands_memory_to_another_stream():
    """The default stream writes x, frees it; ``empty_cache`` frees its segment; side allocates as much and writes
    it (usually at x's address): ordered by the cudaFree (it was an alloc-reuse false alarm)."""
    (side,) = streams("side")
    torch.cuda.empty_cache()
    x = torch.empty(BIG, device="cuda")
    x.fill_(1.0)
    del x
    torch.cuda.empty_cache()
    with torch.cuda.stream(side):
        z = torch.empty(BIG, device="cuda")
        z.fill_(2.0)
    torch.cuda.synchronize()
    del z


# ------------------------------------------------------------------ a destroyed graph's private pool
def _graph_then_side(destroy_output):
    (side,) = streams("side")
    static_in = torch.ones(BIG, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = static_in * 2  # in the graph's private pool
    g.replay()  # on the default stream
    del g
    if destroy_output:
        del static_out
    gc.collect()
    torch.cuda.empty_cache()  # the pool goes back unless static_out still holds its segment
    with torch.cuda.stream(side):
        if destroy_output:
            z = torch.empty(BIG, device="cuda")  # usually at static_out's address
            z.fill_(3.0)
        else:
            z = static_out * 2  # reads the replay's output without waiting for it
    torch.cuda.synchronize()
    del z, static_in


def destroyed_graph_pool_released_then_side_allocates():
    """The graph and its output gone, ``empty_cache`` frees the pool's segment: side's allocation there is ordered
    after the replay's write by the cudaFree."""
    _graph_then_side(destroy_output=True)


def destroyed_graph_output_still_held_read_on_side():
    """The graph destroyed but its output held: the pool's segment stays, and side's read of the output races with
    the replay that wrote it."""
    _graph_then_side(destroy_output=False)


# ------------------------------------------------------------------ the free-and-retry before an out-of-memory error
def _under_memory_fraction(extra, fn):
    """Run fn with the process limited to what it holds now plus ``extra`` bytes (the allocator's free-and-retry
    then runs before it would raise out of memory)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + extra) / total)
    try:
        return fn()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _oom_retry(retry):
    (side,) = streams("side")
    addresses = []

    def program():
        x = torch.empty(GIB // 4, device="cuda")  # 1 GiB on the default stream
        x.fill_(1.0)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            s = x.sum()  # side reads x; no record_stream
        addresses.append(x.data_ptr())
        del x  # cached on the default stream's free list
        if retry:
            with torch.cuda.stream(side):
                z = torch.empty(GIB // 4, device="cuda")  # over the limit: x's segment is freed, then the retry
                z.fill_(2.0)
                addresses.append(z.data_ptr())
        w = torch.empty(N, device="cuda")  # the default stream's next allocation
        w.fill_(0.0)
        torch.cuda.synchronize()
        return s

    _under_memory_fraction(GIB + GIB // 2, program)
    return addresses


def side_read_then_owner_allocates_without_record_stream():
    """x read on side and freed without ``record_stream``, then the default stream allocates: missing record_stream."""
    _oom_retry(retry=False)


def oom_retry_hands_the_block_to_another_stream():
    """The same, but side's 1 GiB allocation first runs into the memory limit: the allocator frees x's cached segment
    (cudaFree, which waits for side's read) and retries, getting x's bytes: nothing of x is pending."""
    _oom_retry(retry=True)


# ------------------------------------------------------------------ external events in a captured graph
def _graph_records_end_event(record_after_copy):
    src = torch.arange(N, device="cuda", dtype=torch.float32)
    dst = torch.empty(N, pin_memory=True)
    end = torch.cuda.Event(external=True)
    end.record()  # (created before the capture)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        if not record_after_copy:
            end.record()
        dst.copy_(src, non_blocking=True)
        if record_after_copy:
            end.record()
    g.replay()
    end.synchronize()
    values = dst.tolist()  # the host reads the copy's destination
    torch.cuda.synchronize()
    return values


def graph_records_end_event_after_the_copy():
    """The replay records ``end`` after the captured copy: ``end.synchronize()`` orders the host's read after it."""
    _graph_records_end_event(record_after_copy=True)


def graph_records_end_event_before_the_copy():
    """``end`` captured before the copy: its record at each replay orders nothing of the copy, the read races."""
    _graph_records_end_event(record_after_copy=False)


def _graph_waits_for_start_event(captured_wait):
    (producer,) = streams("producer")
    src = torch.zeros(N, device="cuda")
    start = torch.cuda.Event(external=True)
    start.record(producer)  # (an event never recorded is no wait node)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        if captured_wait:
            start.wait()
        out = src * 2
    torch.cuda.synchronize()
    producer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        src.fill_(3.0)  # the producer refills the graph's input
        start.record()
    g.replay()  # on the default stream
    torch.cuda.synchronize()
    del out


def graph_waits_for_start_event():
    """The capture waits for ``start`` first: each replay waits for the producer's fill before it reads."""
    _graph_waits_for_start_event(captured_wait=True)


def graph_without_the_start_wait():
    """No captured wait: the replay reads the input while the producer may still fill it."""
    _graph_waits_for_start_event(captured_wait=False)


SCENARIOS = [
    side_read_then_owner_reuse_without_record_stream, side_read_then_empty_cache_then_owner_reuse,
    empty_cache_hands_memory_to_another_stream,
    destroyed_graph_pool_released_then_side_allocates, destroyed_graph_output_still_held_read_on_side,
    side_read_then_owner_allocates_without_record_stream, oom_retry_hands_the_block_to_another_stream,
]
if external_events:
    SCENARIOS += [graph_records_end_event_after_the_copy, graph_records_end_event_before_the_copy,
                  graph_waits_for_start_event, graph_without_the_start_wait]

EXPECTED = {
    "side_read_then_owner_reuse_without_record_stream": [
        ("missing-record-stream", "side", "aten::mul.Tensor", "default", "allocation"),
    ],
    "side_read_then_empty_cache_then_owner_reuse": [],
    "empty_cache_hands_memory_to_another_stream": [],
    "destroyed_graph_pool_released_then_side_allocates": [],
    "destroyed_graph_output_still_held_read_on_side": [
        ("device-device", "default", "CUDAGraph.replay", "side", "aten::mul.Tensor"),
    ],
    "side_read_then_owner_allocates_without_record_stream": [
        ("missing-record-stream", "side", "aten::sum", "default", "allocation"),
    ],
    "oom_retry_hands_the_block_to_another_stream": [],
    "graph_records_end_event_after_the_copy": [],
    "graph_records_end_event_before_the_copy": [
        ("host-device", "default", "CUDAGraph.replay", "host", "Tensor.tolist"),
    ],
    "graph_waits_for_start_event": [],
    "graph_without_the_start_wait": [
        ("device-device", "producer", "aten::fill_.Scalar", "default", "CUDAGraph.replay"),
    ],
}
if not external_events:
    EXPECTED = {k: v for k, v in EXPECTED.items() if "event" not in k}

# The native caching allocator's segments and retries: the cudaMallocAsync backend hands memory over in stream order
# (its own rule), with no segments for empty_cache to free, and no per-process memory fraction.
ALLOCATOR_SPECIFIC = "a program about the native caching allocator's segments"
UNDER_CUDA_MALLOC_ASYNC = {f.__name__: ALLOCATOR_SPECIFIC for f in SCENARIOS[:7]}

test_every_scenario_has_an_expectation, test_scenario = scenario_tests(
    SCENARIOS, EXPECTED, under_async=UNDER_CUDA_MALLOC_ASYNC)


def test_the_retry_program_really_retries_and_reuses_the_address():
    """What makes oom_retry_hands_the_block_to_another_stream a test of the retry: untraced, side's allocation runs
    the allocator's free-and-retry and gets x's address."""
    if torch.cuda.memory.get_allocator_backend() != "native":
        pytest.skip(ALLOCATOR_SPECIFIC)
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    x_at, z_at = _oom_retry(retry=True)
    assert torch.cuda.memory_stats()["num_alloc_retries"] == retries + 1
    assert z_at == x_at


def test_the_release_programs_reuse_the_address():
    """empty_cache_hands_memory_to_another_stream and the destroyed graph's pool, untraced: the side stream's
    allocation gets the released bytes (else those programs would test nothing)."""
    if torch.cuda.memory.get_allocator_backend() != "native":
        pytest.skip(ALLOCATOR_SPECIFIC)
    (side,) = streams("side")
    torch.cuda.empty_cache()
    x = torch.empty(BIG, device="cuda")
    at = x.data_ptr()
    del x
    torch.cuda.empty_cache()
    with torch.cuda.stream(side):
        z = torch.empty(BIG, device="cuda")
    assert z.data_ptr() == at
    del z
    static_in = torch.ones(BIG, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = static_in * 2
    at = static_out.data_ptr()
    del g, static_out
    gc.collect()
    torch.cuda.empty_cache()
    with torch.cuda.stream(side):
        z = torch.empty(BIG, device="cuda")
    assert z.data_ptr() == at
