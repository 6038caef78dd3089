"""The caching allocator model and PyTorch <-> CuPy interop, each as a small program and its fix (or a program that
must stay clean).

docs/semantics.md is the contract: a device block belongs to the stream current at its allocation (its owner);
once freed, the caching allocator may hand it to the owner's next allocation at once, unless ``record_stream(B)``
made it wait for B's work enqueued before the free; the foreign accesses of a freed block (those of streams that
are neither its owner nor recorded) that are not ordered before the owner's *next allocation* are a
``missing-record-stream`` finding, whatever that allocation's size or address; history survives frees. The
programs probe that model where it is easy to get wrong: a smaller allocation that splits the freed block,
``torch.cuda.empty_cache()`` between the free and the reuse (no fence: a segment with a live block stays cached),
a block that only its owner used, the free of a block shared by views, a tensor that a generator hands out, an LRU
cache evicting entries, ``torch.cuda.MemPool``, and the boundary with CuPy (torch memory read by a CuPy stream,
CuPy pool memory written by torch, a stream shared through ``torch.cuda.ExternalStream``). Every program is plain
PyTorch (and CuPy for the second table) with tensors of at most 1 << 16 elements; each racy version lacks exactly
the edge under test.

EXPECTED / CUPY_EXPECTED map each scenario to the (kind, previous stream role, previous op, current stream role,
current op) tuples docs/semantics.md implies, in the order streamsan reports them; fixed programs expect ``[]``.
Stream roles: "default" (torch's default stream, which is CuPy's ``Stream.null``), "host", and the side streams
each program names ("side", "prefetch", "load", "producer", "cupy_side"). A missing-record-stream finding's
current op is "allocation", on the owner stream. The torch table runs without CuPy; the CuPy table is skipped
without it (its CuPy streams are non-blocking: CUDA orders them with nothing).

A block freed into a ``MemPool`` is handed only to allocations routed to that pool: the tracer tags the allocations
made under ``torch.cuda.use_mem_pool`` with their pool, and the analyzer checks such a block's pending accesses at
the owner's next allocation from that pool only (it was a false report before).
"""

import collections
import contextlib

import numpy
import pytest
import torch
from tests.gpu.support.scenario_kit import cupy_streams, scenario_tests, streams


try:
    import cupy
except Exception:  # CuPy missing or unusable: the CuPy table is skipped
    cupy = None
HAVE_CUPY = cupy is not None and cupy.cuda.is_available()

N = 1 << 16
F32 = numpy.float32


# ------------------------------------------------------------------ a freed block split by a smaller allocation
def _split_block(fix):
    (side,) = streams("side")
    cur = torch.cuda.current_stream()
    with torch.cuda.stream(side):
        x = torch.empty(N, device="cuda")  # owner: side
        x.fill_(1.0)
    cur.wait_stream(side)
    y = x * 2  # the default stream reads side's block
    if fix == "record":
        x.record_stream(cur)
    elif fix == "sync":
        cur.synchronize()  # the host waits for the read: nothing of it is pending at the free
    del x
    with torch.cuda.stream(side):
        z = torch.empty(N // 4, device="cuda")  # best fit on side's free list: a split of x's block
        z.fill_(5.0)
    torch.cuda.synchronize()
    del y, z


def split_block_reused_without_record_stream():
    """The classic missing ``record_stream`` where the reuse is a *smaller* allocation: side's free list may split
    x's block and hand its first quarter to z while the default stream still reads x. The finding is made at side's
    next allocation whatever its size; z's write over x's first bytes is folded into it."""
    _split_block(fix=None)


def split_block_recorded_before_free():
    """The fix: ``x.record_stream(default)`` before the free; the allocator reuses the block (whole or split) only
    after the default stream's read."""
    _split_block(fix="record")


def split_block_freed_after_host_sync():
    """The other fix: the host synchronizes the default stream before the free; the read is done when the block
    goes back to side's free list, and side's later work is enqueued after the synchronization."""
    _split_block(fix="sync")


# ------------------------------------------------------------------ empty_cache between the free and the reuse
def _empty_cache_between(record):
    (side,) = streams("side")
    cur = torch.cuda.current_stream()
    torch.cuda.empty_cache()  # side's free list starts empty: keep and x share one fresh segment
    with torch.cuda.stream(side):
        keep = torch.empty(N, device="cuda")  # stays alive: its segment cannot be released
        keep.fill_(0.0)
        x = torch.empty(N, device="cuda")
        x.fill_(1.0)
    cur.wait_stream(side)
    y = x * 2
    if record:
        x.record_stream(cur)
    del x
    torch.cuda.empty_cache()  # releases wholly free segments only: x's block stays cached for side
    with torch.cuda.stream(side):
        z = torch.empty(N, device="cuda")  # x's block
        z.fill_(5.0)
    torch.cuda.synchronize()
    del keep, y, z


def empty_cache_is_no_fence():
    """``torch.cuda.empty_cache()`` between the free and side's next allocation orders nothing (no traced event, and
    none the program could rely on: a segment that holds a live block, here ``keep``, is not released, so x's block
    is still side's to hand out). Still the missing ``record_stream`` of split_block_reused_without_record_stream."""
    _empty_cache_between(record=False)


def empty_cache_after_record_stream():
    """The fix: x is recorded on the default stream before the free; the allocator returns its block to side's free
    list only once the default stream's read is done (empty_cache waits for that event itself)."""
    _empty_cache_between(record=True)


# ------------------------------------------------------------------ a block only its owner used
def default_block_not_handed_to_side_stream():
    """A tensor allocated, used and freed on the default stream alone leaves nothing pending (no foreign access),
    and the caching allocator never hands a block of the default stream's free list to another stream: side's
    allocation gets memory of its own, and its write there conflicts with no earlier life."""
    (side,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    y = x * 2
    del x
    with torch.cuda.stream(side):
        z = torch.empty(N, device="cuda")
        z.fill_(5.0)
    torch.cuda.synchronize()
    del y, z


# ------------------------------------------------------------------ a generator handing out side-stream tensors
def _batches_on(stream, count):
    """A prefetching producer: each batch is made on its own stream and handed to the caller as it is."""
    for i in range(count):
        with torch.cuda.stream(stream):
            batch = torch.empty(N, device="cuda")
            batch.fill_(float(i))
        yield batch


def _consume_batches(record):
    (prefetch,) = streams("prefetch")
    cur = torch.cuda.current_stream()
    total = torch.empty(N, device="cuda")
    total.fill_(0.0)
    for batch in _batches_on(prefetch, 3):
        cur.wait_stream(prefetch)  # the read is ordered after the batch was made
        total.add_(batch)
        if record:
            batch.record_stream(cur)
    torch.cuda.synchronize()
    del total


def generator_drops_batches_without_record_stream():
    """A generator yields tensors made on its prefetch stream; the loop reads each on the default stream and drops
    it when it takes the next one. The generator allocates batch i+1 before the loop lets go of batch i, so the
    hazard first shows at the third batch: the prefetch stream's allocation may take batch 0's block while the
    default stream's ``add_`` may still read it (one finding: batch 1's free has no later allocation)."""
    _consume_batches(record=False)


def generator_consumer_records_batches():
    """The fix: the consumer records its stream on each batch it reads."""
    _consume_batches(record=True)


# ------------------------------------------------------------------ an LRU cache evicting side-stream entries
class _SideStreamCache:
    """An LRU cache of tensors materialized on a stream of its own (a weight or embedding cache that loads
    asynchronously); ``get`` makes the caller's stream wait for the entry. Eviction drops the cache's reference,
    the only one: the block goes back to the load stream's free list. ``record``: ``get`` records the caller's
    stream on the entry it hands out."""

    def __init__(self, capacity, record):
        (self.stream,) = streams("load")
        self.capacity = capacity
        self.record = record
        self.entries = collections.OrderedDict()

    def get(self, key):
        t = self.entries.get(key)
        if t is None:
            if len(self.entries) >= self.capacity:
                self.entries.popitem(last=False)  # evict the least recently used entry
            with torch.cuda.stream(self.stream):
                t = torch.empty(N, device="cuda")
                t.fill_(float(key))
            self.entries[key] = t
        else:
            self.entries.move_to_end(key)
        cur = torch.cuda.current_stream()
        cur.wait_stream(self.stream)
        if self.record:
            t.record_stream(cur)
        return t


def _lru_lookups(record):
    cache = _SideStreamCache(capacity=2, record=record)
    q = torch.empty(N, device="cuda")
    q.fill_(0.5)
    scores = [torch.dot(cache.get(key), q) for key in (0, 1, 0, 2, 3)]
    torch.cuda.synchronize()
    del scores


def lru_cache_evicts_without_record_stream():
    """Looking up 0, 1, 0, 2, 3 with room for two entries evicts 1 (then 0) right before the load stream allocates
    the new entry, which may take the evicted block while the default stream's ``dot`` may still read it (one
    finding, count 2)."""
    _lru_lookups(record=False)


def lru_cache_records_on_get():
    """The fix: every entry handed out is recorded on the caller's stream, so eviction defers the block's reuse."""
    _lru_lookups(record=True)


# ------------------------------------------------------------------ a list of views of one block
def _side_chunks(stream, parts):
    with torch.cuda.stream(stream):
        buf = torch.empty(N, device="cuda")
        buf.fill_(1.0)
    return list(buf.split(N // parts))  # views of one block: it is freed when the last of them dies


def _consume_chunks(record):
    (producer,) = streams("producer")
    cur = torch.cuda.current_stream()
    outs = []
    for _ in range(2):
        chunks = _side_chunks(producer, 4)
        cur.wait_stream(producer)
        if record:
            chunks[-1].record_stream(cur)  # one view, at an offset: the allocator records the whole block
        outs.append(torch.cat(chunks))
        del chunks
    torch.cuda.synchronize()
    del outs


def split_chunks_freed_without_record_stream():
    """A producer returns a list of chunks (views of one block made on its stream); the caller concatenates them on
    the default stream and drops the list, which frees the block; the producer's next buffer may be handed that
    block while ``cat`` may still read it."""
    _consume_chunks(record=False)


def split_chunks_recorded_through_one_view():
    """The fix: ``record_stream`` on any one view (here the last chunk, at a storage offset) records the block its
    storage lives in."""
    _consume_chunks(record=True)


# ------------------------------------------------------------------ torch.cuda.MemPool
def _mem_pool():
    if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
        pytest.skip("needs torch.cuda.MemPool and torch.cuda.use_mem_pool")
    return torch.cuda.MemPool()


def _pooled_block(record, reuse_in_pool):
    pool = _mem_pool()
    (side,) = streams("side")
    cur = torch.cuda.current_stream()
    with torch.cuda.use_mem_pool(pool), torch.cuda.stream(side):
        x = torch.empty(N, device="cuda")  # from the pool, owner: side
        x.fill_(1.0)
    cur.wait_stream(side)
    y = x * 2  # y from the default pool
    if record:
        x.record_stream(cur)
    del x  # back to the pool's free list, under side
    routed = torch.cuda.use_mem_pool(pool) if reuse_in_pool else contextlib.nullcontext()
    with routed, torch.cuda.stream(side):
        z = torch.empty(N, device="cuda")
        z.fill_(5.0)
    torch.cuda.synchronize()
    del y, z  # before the pool goes


def mempool_block_reused_without_record_stream():
    """A private ``MemPool`` keeps the caching allocator's per-stream rule: x, allocated in the pool on side and
    read by the default stream, is freed without ``record_stream``, and side's next allocation in the pool may
    take its block at once."""
    _pooled_block(record=False, reuse_in_pool=True)


def mempool_block_recorded():
    """The fix: ``record_stream`` works on pool blocks as on any other."""
    _pooled_block(record=True, reuse_in_pool=True)


def mempool_block_not_reused_outside_pool():
    """The same free, but side's next allocation is outside the pool: the allocator hands a pool's blocks only to
    allocations routed to that pool, so z never gets x's block and nothing later allocates in the pool: the
    program is clean (streamsan once reported it at side's next allocation, as if the pool were side's own free
    lists)."""
    _pooled_block(record=False, reuse_in_pool=False)


SCENARIOS = [
    split_block_reused_without_record_stream, split_block_recorded_before_free, split_block_freed_after_host_sync,
    empty_cache_is_no_fence, empty_cache_after_record_stream,
    default_block_not_handed_to_side_stream,
    generator_drops_batches_without_record_stream, generator_consumer_records_batches,
    lru_cache_evicts_without_record_stream, lru_cache_records_on_get,
    split_chunks_freed_without_record_stream, split_chunks_recorded_through_one_view,
    mempool_block_reused_without_record_stream, mempool_block_recorded, mempool_block_not_reused_outside_pool,
]

# (kind, previous role, previous op, current role, current op) per scenario, in the order streamsan reports them
# (by the previous access's position in the trace).
EXPECTED = {
    "split_block_reused_without_record_stream": [
        ("missing-record-stream", "default", "aten::mul.Tensor", "side", "allocation"),
    ],
    "split_block_recorded_before_free": [],
    "split_block_freed_after_host_sync": [],
    "empty_cache_is_no_fence": [
        ("missing-record-stream", "default", "aten::mul.Tensor", "side", "allocation"),
    ],
    "empty_cache_after_record_stream": [],
    "default_block_not_handed_to_side_stream": [],
    "generator_drops_batches_without_record_stream": [
        ("missing-record-stream", "default", "aten::add_.Tensor", "prefetch", "allocation"),
    ],
    "generator_consumer_records_batches": [],
    # evictions of 1 and of 0: one finding, count 2
    "lru_cache_evicts_without_record_stream": [
        ("missing-record-stream", "default", "aten::dot", "load", "allocation"),
    ],
    "lru_cache_records_on_get": [],
    "split_chunks_freed_without_record_stream": [
        ("missing-record-stream", "default", "aten::cat", "producer", "allocation"),
    ],
    "split_chunks_recorded_through_one_view": [],
    "mempool_block_reused_without_record_stream": [
        ("missing-record-stream", "default", "aten::mul.Tensor", "side", "allocation"),
    ],
    "mempool_block_recorded": [],
    "mempool_block_not_reused_outside_pool": [],
}

NO_POOLS = "PyTorch's cudaMallocAsync backend has no private memory pools (MemPool)"
UNDER_CUDA_MALLOC_ASYNC = {"mempool_block_reused_without_record_stream": NO_POOLS, "mempool_block_recorded": NO_POOLS,
                           "mempool_block_not_reused_outside_pool": NO_POOLS}

test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED,
                                                                       under_async=UNDER_CUDA_MALLOC_ASYNC)


# ================================================================== PyTorch <-> CuPy (skipped without CuPy)
def _sync():
    torch.cuda.synchronize()
    cupy.cuda.Device().synchronize()


def _torch_block_read_by_cupy(record):
    (cs,) = cupy_streams("cupy_side")
    t = torch.empty(N, device="cuda")  # torch's allocator, owner: the default stream
    t.fill_(1.0)
    with cs:
        x = cupy.from_dlpack(t)  # t.__dlpack__(stream=cs): cs waits for the default stream's fill
        y = x * 2.0  # CuPy reads t's block on cs
    if record:
        t.record_stream(torch.cuda.ExternalStream(cs.ptr))
    del x, t  # the DLPack capsule let go of t: its block goes back to the default stream's free list
    z = torch.empty(N, device="cuda")  # may be t's block
    z.fill_(3.0)
    _sync()
    del y, z


def torch_block_freed_while_cupy_reads():
    """DLPack's stream hand-off orders the consumer after the producer, not the producer's *free* after the
    consumer: a torch tensor read by CuPy on a non-blocking CuPy stream and then dropped goes back to torch's
    free list for the default stream, whose next allocation may take it while CuPy's kernel may still read it."""
    _torch_block_read_by_cupy(record=False)


def torch_block_recorded_on_cupy_stream():
    """The fix: ``t.record_stream(torch.cuda.ExternalStream(cs.ptr))`` names the CuPy stream to torch's allocator
    (the same stream: streams are identified by their handle)."""
    _torch_block_read_by_cupy(record=True)


def _cupy_block_written_by_torch(wait):
    (cs,) = cupy_streams("cupy_side")
    with cs:
        x = cupy.empty(N, dtype=F32)  # CuPy's pool files the block under cs
        x.fill(1.0)
        t = torch.from_dlpack(x)  # x.__dlpack__(stream=torch's stream): the default stream waits for cs
    t.mul_(2.0)  # torch writes CuPy's block on the default stream
    if wait:
        torch.cuda.ExternalStream(cs.ptr).wait_stream(torch.cuda.current_stream())
    del t, x  # the last reference: the block goes back to cs's arena (CuPy has no record_stream)
    with cs:
        w = cupy.empty(N, dtype=F32)  # may be x's block
        w.fill(3.0)
    _sync()
    del w


def cupy_block_freed_while_torch_writes():
    """The converse: a CuPy array allocated on its stream's arena, handed to torch with ``torch.from_dlpack`` (the
    hand-off itself is right) and written by torch on the default stream, is dropped; CuPy's pool may give the
    block to cs's next allocation while torch's ``mul_`` may still write it."""
    _cupy_block_written_by_torch(wait=False)


def cupy_stream_waits_torch_before_reallocating():
    """The fix CuPy's pool needs (it has no record_stream): cs waits for torch's stream before it allocates again,
    here spelled with torch's API on an ``ExternalStream`` of cs."""
    _cupy_block_written_by_torch(wait=True)


def cupy_array_to_torch_outside_producer_stream():
    """``torch.from_dlpack(x)`` called after leaving ``with cs:``: CuPy makes torch's stream wait for its *current*
    stream, now the null stream, not for cs that wrote x, so torch's ``mul_`` may run before the fill (the fixed
    hand-off, inside ``with cs:``, is cupy_stream_waits_torch_before_reallocating's and
    tests/gpu/cupy/test_cupy_projects_and_interop.py's)."""
    (cs,) = cupy_streams("cupy_side")
    with cs:
        x = cupy.empty(N, dtype=F32)
        x.fill(1.0)
    t = torch.from_dlpack(x)
    t.mul_(2.0)
    _sync()
    del t, x


def torch_ops_on_cupy_stream_via_external_stream():
    """Both libraries on one stream: torch allocates and writes under ``torch.cuda.ExternalStream(cs.ptr)`` (the
    block's owner is cs), CuPy reads and writes the same memory through ``cupy.asarray`` (the CUDA array
    interface, no hand-off: none is needed), torch reads it back, and the block is freed and taken again by the
    next step's allocation on the same stream: every access is cs's own."""
    (cs,) = cupy_streams("cupy_side")
    ext = torch.cuda.ExternalStream(cs.ptr)
    sums = []
    for step in range(2):
        with torch.cuda.stream(ext):
            t = torch.empty(N, device="cuda")
            t.fill_(float(step))
        with cs:
            x = cupy.asarray(t)
            x *= 2.0
        with torch.cuda.stream(ext):
            sums.append(t.sum())
        del x, t
    _sync()
    del sums


CUPY_SCENARIOS = [
    torch_block_freed_while_cupy_reads, torch_block_recorded_on_cupy_stream,
    cupy_block_freed_while_torch_writes, cupy_stream_waits_torch_before_reallocating,
    cupy_array_to_torch_outside_producer_stream, torch_ops_on_cupy_stream_via_external_stream,
]

CUPY_EXPECTED = {
    "torch_block_freed_while_cupy_reads": [
        ("missing-record-stream", "cupy_side", "cupy.ndarray.__mul__", "default", "allocation"),
    ],
    "torch_block_recorded_on_cupy_stream": [],
    "cupy_block_freed_while_torch_writes": [
        ("missing-record-stream", "default", "aten::mul_.Tensor", "cupy_side", "allocation"),
    ],
    "cupy_stream_waits_torch_before_reallocating": [],
    "cupy_array_to_torch_outside_producer_stream": [
        ("device-device", "cupy_side", "cupy.ndarray.fill", "default", "aten::mul_.Tensor"),
    ],
    "torch_ops_on_cupy_stream_via_external_stream": [],
}


test_every_cupy_scenario_has_an_expectation, test_cupy_scenario = scenario_tests(CUPY_SCENARIOS, CUPY_EXPECTED,
                                                                                 tracer="cupy")
test_cupy_scenario = pytest.mark.skipif(not HAVE_CUPY, reason="needs CuPy with a CUDA GPU")(test_cupy_scenario)
