"""The rule for memory of an allocator that reports no allocations or frees (``E.UNREPORTED_POOL``: PyTorch's
cudaMallocAsync backend), on hand-built event sequences: an allocation is a write on its stream; over a block
still live it ends that block's life, what the block's owner and recorded users had seen comes before it, other
streams' accesses race with it: a missing record_stream, found where the memory is handed out again.

Streams A=1, B=2, C=3 on device 0; device memory at ``BASE``.
"""

from __future__ import annotations

import pytest

from streamsan import events as E
from streamsan.events import UNREPORTED_POOL, alloc, event_record, event_wait, op, record_stream, stream_sync
from streamsan.analysis.findings import ALLOC_REUSE, MISSING_RECORD_STREAM
from tests.support.rules_kit import BASE, KB, A, B, C, D, check, none, run, streams

OVERLAP_NOTE = ("warning", "an allocation overlapped live memory (a free was not seen)")


def U(agent, what="", size=1 * KB, off=0):
    """A declared allocation of the unreporting allocator at BASE + off, on ``agent``."""
    return alloc(0, BASE + off, size, agent, what=what, pool=UNREPORTED_POOL)


def owner_used():
    """A block allocated on A, written and read by A only: its free (unseen) comes after both."""
    return streams(A, B, C) + [U(A, "old"), op(A, "fill_", writes=[D(0, 1 * KB)]), op(A, "sum", reads=[D(0, KB)])]


def test_reuse_on_another_stream_after_the_owner_alone_used_it_is_ordered():
    a = none(owner_used() + [U(B, "new"), op(B, "fill_", writes=[D(0, 1 * KB)])])
    assert OVERLAP_NOTE not in a.notes
    assert a.counts["allocs"] == 2


def test_the_same_events_from_a_reporting_allocator_race():
    """Without the pool the new block overlaps a live one: a free the tracer missed, so the old accesses of the
    stream the block is handed to again stay (on another stream or pool, the memory went back to the driver)."""
    evs = streams(A, B, C) + [alloc(0, BASE, KB, A, what="old"), op(B, "fill_", writes=[D(0, 1 * KB)]),
                              alloc(0, BASE, KB, A, what="new"), op(A, "fill_", writes=[D(0, 1 * KB)])]
    a = run(evs)
    fs = a.sorted_findings()
    assert len(fs) == 1
    check(fs[0], ALLOC_REUSE, (B, "fill_"), (A, "fill_"), BASE, BASE + KB)
    assert OVERLAP_NOTE in a.notes


def foreign_reader():
    """A block on A, written by A, read by B after waiting for A."""
    return streams(A, B, C) + [U(A, "old"), op(A, "fill_", writes=[D(0, 1 * KB)]), event_record(1, A),
                               event_wait(1, B), op(B, "cat", reads=[D(0, KB)])]


def test_an_unrecorded_foreign_access_races_with_the_next_allocation():
    """The missing record_stream: B's read may still run when the driver hands the memory to A's allocation."""
    a = run(foreign_reader() + [U(A, "new"), op(A, "fill_", writes=[D(0, 1 * KB)])])
    fs = a.sorted_findings()
    assert len(fs) == 1
    check(fs[0], MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + KB, prev_write=False,
          cur_write=True)
    assert (fs[0].prev_block.what, fs[0].block.what, fs[0].reused) == ("old", "new", True)


def test_the_report_names_the_old_owner_and_the_allocating_stream():
    """The driver may hand A's freed memory to C: the report says whose tensor it was and where it went."""
    from streamsan.report.build import race_item

    a = run(foreign_reader() + [U(C, "new"), op(C, "fill_", writes=[D(0, 1 * KB)])])
    (f,) = a.sorted_findings()
    item = race_item(a, f)
    assert (item["kind"], item["allocation"]["reused"]) == (MISSING_RECORD_STREAM, True)
    assert item["memory"]["what"] == "old"
    assert item["missing_edge"] == (
        "The tensor on stream 0x1000 was used on stream 0x2000 (cat (read) at op:cat) and freed without "
        "record_stream, and stream 0x3000 never waited for stream 0x2000: the caching allocator was free to hand "
        "its memory to the allocation at op:allocation on stream 0x3000 while that use may still be pending. It did "
        "on this run.")


def test_memory_used_on_another_stream_without_waiting_for_the_allocation_races_with_it():
    """The allocation is stream-ordered work on its stream: C writes the new memory before A may have got it (the
    owner's old accesses are ordered before the allocation, not before C)."""
    a = run(owner_used() + [U(A, "new"), op(C, "zero_", writes=[D(0, KB)])])
    fs = a.sorted_findings()
    assert len(fs) == 1
    check(fs[0], "device-device", (A, "allocation"), (C, "zero_"), BASE, BASE + KB)


def test_waiting_for_the_allocating_stream_orders_the_use():
    none(owner_used() + [U(A, "new"), event_record(2, A), event_wait(2, C), op(C, "zero_", writes=[D(0, KB)])])


def test_a_recorded_foreign_access_is_ordered_before_the_next_life():
    none(foreign_reader() + [record_stream(0, BASE, B), U(C, "new"), op(C, "fill_", writes=[D(0, 1 * KB)])])


def test_a_foreign_access_the_host_synchronized_past_is_ordered():
    none(foreign_reader() + [stream_sync(B), U(C, "new"), op(C, "fill_", writes=[D(0, 1 * KB)])])


def test_only_the_overlapped_bytes_end_their_life():
    """A new block over the old one's second half: the first half keeps its history (A's write there still
    races with a later write by C, which no new allocation orders); on the second half, B's unrecorded read races
    with the allocation."""
    a = run(foreign_reader() + [U(C, "new", size=512, off=512), op(C, "fill_", writes=[D(512, 512)]),
                                op(C, "zero_", writes=[D(0, 512)])])
    fs = a.sorted_findings()
    assert [(f.kind, f.previous.agent, f.previous.name, f.current.name, f.lo, f.hi) for f in fs] == [
        ("device-device", A, "fill_", "zero_", BASE, BASE + 512),
        (MISSING_RECORD_STREAM, B, "cat", "allocation", BASE + 512, BASE + KB)]


def test_memory_no_declared_block_held_is_forgotten():
    """Accesses to memory allocated before tracing began: nothing tells whose it was, so a new life starts
    clean."""
    evs = streams(A, B) + [op(A, "fill_", writes=[D(0, KB)]), U(B, "new"), op(B, "fill_", writes=[D(0, KB)])]
    none(evs)


def test_within_one_life_races_are_found_as_ever():
    a = run(owner_used() + [op(B, "fill_", writes=[D(0, KB)])])
    fs = a.sorted_findings()
    assert [(f.kind, f.previous.agent, f.previous.name, f.current.agent) for f in fs] == [
        ("device-device", A, "fill_", B)]


def test_pool_is_a_valid_field_of_trace_files():
    ev = U(A, "x")
    assert ev[8] == UNREPORTED_POOL
    assert E.validate(list(ev)) == ev


class _FakeMode:
    """Stands for a dispatch mode with the C tracer installed as its instance ``__torch_dispatch__``."""

    def __init__(self):
        self.__torch_dispatch__ = object()


def _backend(monkeypatch, initialized, name):
    torch = pytest.importorskip("torch")
    from streamsan.tracers.torch.allocators import AllocatorBackend

    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: asked.append(1) or name)
    b = AllocatorBackend()
    mode = _FakeMode()
    b.modes.add(mode)
    return b, mode, asked


def test_the_backend_is_not_asked_before_cuda_starts(monkeypatch):
    """Asking would read PYTORCH_CUDA_ALLOC_CONF before the program sets it."""
    b, mode, asked = _backend(monkeypatch, False, "cudaMallocAsync")
    assert b.learn() is None and asked == []
    assert "__torch_dispatch__" in vars(mode)


def test_cuda_malloc_async_takes_every_mode_off_the_c_tracer(monkeypatch):
    b, mode, asked = _backend(monkeypatch, True, "cudaMallocAsync")
    assert b.learn() is True and b.learn() is True and asked == [1]
    assert "__torch_dispatch__" not in vars(mode)


def test_a_program_s_own_allocator_takes_every_mode_off_the_c_tracer(monkeypatch):
    """``torch.cuda.memory.change_current_allocator`` (RMM's, say): PyTorch's GPU trace hears nothing from it."""
    b, mode, asked = _backend(monkeypatch, True, "pluggable")
    assert b.learn() is True and asked == [1] and b.name == "pluggable"
    assert "__torch_dispatch__" not in vars(mode)


def test_the_native_allocator_changes_nothing(monkeypatch):
    b, mode, _ = _backend(monkeypatch, True, "native")
    assert b.learn() is False
    assert "__torch_dispatch__" in vars(mode)


class _Emits:
    """Stands for a tracer: what ``AllocatorBackend.watch`` emits through it."""

    def __init__(self):
        self.tracing = True
        self.events = []

    def emit(self, ev):
        self.events.append(ev)


def test_a_watched_block_is_freed_when_the_last_tensor_on_its_storage_dies():
    torch = pytest.importorskip("torch")
    from streamsan.tracers.torch.allocators import AllocatorBackend

    b, tracer = AllocatorBackend(), _Emits()
    x = torch.zeros(64)
    base = x.untyped_storage().data_ptr()
    b.watch(tracer, 0, base, x.untyped_storage())
    view = x[8:16]
    del x
    assert tracer.events == []  # the view keeps the storage
    del view
    assert tracer.events == [(E.FREE, 0, base, 0)] and b.watched == {}


def test_a_resized_storage_is_freed_by_the_resize_not_again_at_its_death():
    torch = pytest.importorskip("torch")
    from streamsan.tracers.torch.allocators import AllocatorBackend

    b, tracer, other = AllocatorBackend(), _Emits(), _Emits()
    x = torch.zeros(64)
    base = x.untyped_storage().data_ptr()
    b.watch(tracer, 0, base, x.untyped_storage())
    assert not b.resized(other, base) and b.resized(tracer, base) and not b.resized(tracer, base)
    del x
    assert tracer.events == []


def test_a_stopped_tracer_forgets_its_blocks_and_a_paused_one_emits_nothing():
    torch = pytest.importorskip("torch")
    from streamsan.tracers.torch.allocators import AllocatorBackend

    b, tracer, paused = AllocatorBackend(), _Emits(), _Emits()
    paused.tracing = False
    x, y = torch.zeros(64), torch.zeros(64)
    b.watch(tracer, 0, x.untyped_storage().data_ptr(), x.untyped_storage())
    b.watch(paused, 0, y.untyped_storage().data_ptr(), y.untyped_storage())
    b.forget(tracer)
    del x, y
    assert tracer.events == [] and paused.events == [] and b.watched == {}


def test_a_seen_free_finds_the_missing_record_stream_at_the_owner_s_next_allocation_anywhere():
    """With the free seen, the native rule applies: B's unrecorded read of A's freed block races with A's next
    allocation, wherever the driver puts it."""
    a = run(foreign_reader() + [E.free(0, BASE), U(A, "new", off=4 * KB), op(A, "fill_", writes=[D(4 * KB, KB)])])
    fs = a.sorted_findings()
    assert len(fs) == 1
    check(fs[0], MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + KB, prev_write=False,
          cur_write=True)
    assert fs[0].reused is False


def test_no_block_is_watched_where_storage_objects_die_before_their_storage(monkeypatch):
    """A torch whose storages' Python objects die with the temporary that made them would free every block at once:
    nothing is watched there."""
    torch = pytest.importorskip("torch")
    from streamsan.tracers.torch import allocators

    monkeypatch.setattr(allocators, "storage_objects_live_with_their_storage", lambda: False)
    b, tracer = allocators.AllocatorBackend(), _Emits()
    x = torch.zeros(64)
    b.watch(tracer, 0, x.untyped_storage().data_ptr(), x.untyped_storage())
    del x
    assert tracer.events == [] and b.watched == {}


def test_this_torch_keeps_storage_objects_alive_with_their_storage():
    pytest.importorskip("torch")
    from streamsan.tracers.torch.allocators import storage_objects_live_with_their_storage

    assert storage_objects_live_with_their_storage()


@pytest.fixture
def unreporting(monkeypatch):
    """A torch tracer, tracing, under an allocator backend that reports nothing (the process's one, changed for the
    test)."""
    pytest.importorskip("torch")
    from streamsan.sink import EventBuffer
    from streamsan.tracers.torch import device
    from streamsan.tracers.torch.allocators import ALLOCATOR
    from streamsan.tracers.torch.tracer import TorchTracer

    monkeypatch.setattr(ALLOCATOR, "unreported", True)
    monkeypatch.setattr(ALLOCATOR, "name", "cudaMallocAsync")
    monkeypatch.setattr(ALLOCATOR, "watched", {})
    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x1000)
    tracer = TorchTracer(EventBuffer())
    tracer.tracing = True
    return tracer


def test_an_op_s_declared_output_is_freed_when_its_last_tensor_dies(unreporting):
    from streamsan.tracers.torch.allocators import declare_outputs
    from tests.support.torch_kit import cuda_like

    tracer = unreporting
    out = cuda_like(16)
    base = out.untyped_storage().data_ptr()
    evs = tracer.buffer.events
    mark = len(evs)
    declare_outputs(tracer, evs, mark, out, 0, A, 5, 0)
    view = out[4:]
    del out
    assert evs[mark:] == [(E.ALLOC, 0, base, 64, A, 5, 0, "float32[16]", UNREPORTED_POOL)]
    del view
    assert evs[mark + 1:] == [(E.FREE, 0, base, 0)]


class _Storage:
    """Stands for a CUDA storage a resize moves (weakly referenceable, as PyTorch's are)."""

    def __init__(self, ptr, n):
        self.device = type("Device", (), {"index": 0})()
        self.ptr, self.n = ptr, n

    def data_ptr(self):
        return self.ptr

    def nbytes(self):
        return self.n


def test_a_storage_resize_declares_the_new_block_and_frees_the_old_one(unreporting):
    """FSDP's ``resize_`` of a flat parameter's storage: no callback reports the new block or the old one's free."""
    from streamsan.tracers.torch.allocators import ALLOCATOR
    from streamsan.tracers.torch.patches import storage_resize

    tracer = unreporting
    st = _Storage(0x5000, 64)
    ALLOCATOR.watch(tracer, 0, 0x5000, st)  # declared when an op made it

    def orig(storage, size):
        storage.ptr, storage.n = 0x9000, size

    mark = len(tracer.buffer.events)
    storage_resize.resize(tracer, orig, st, 128)
    a = tracer.agent(0, 0x1000)
    evs = [ev for ev in tracer.buffer.events[mark:] if ev[0] not in (E.STREAM, E.DEF_STACK)]
    assert [ev[0] for ev in evs] == [E.ALLOC, E.OP, E.FREE]
    assert evs[0][1:5] == (0, 0x9000, 128, a) and evs[0][7:] == ("storage", UNREPORTED_POOL)
    assert evs[1][1:5] == (a, "UntypedStorage.resize_", ((0, 0x5000, 64),), ((0, 0x9000, 64),))
    assert evs[2] == (E.FREE, 0, 0x5000, 0)
    assert set(ALLOCATOR.watched) == {0x9000}  # the storage, watched at its new block
