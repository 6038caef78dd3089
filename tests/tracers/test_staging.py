"""Host writes to pinned staging buffers that no traced call shows (``streamsan.tracers.staging``): the bytes an
asynchronous copy read, compared at the next copy from the same place. CPU only: ctypes buffers stand in for
pinned memory, and the tracer-level tests register a CPU tensor as a pinned block by hand."""

import ctypes

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamsan import events as E
from streamsan.tracers.staging import LIMIT, MAX_BLOCKS, WRITE_SEEN, PinnedStaging, changed_span


class Owner:
    """Holds a buffer, like the tensor or array that keeps a pinned block alive."""

    def __init__(self, n):
        self.buf = ctypes.create_string_buffer(n)
        self.base = ctypes.addressof(self.buf)


def staging():
    return PinnedStaging(lambda owner: owner.base)


def rng(owner, lo, hi):
    return (E.PINNED, owner.base + lo, hi - lo)


def test_changed_bytes_are_the_host_write_since_the_previous_copy():
    s, o = staging(), Owner(64)
    assert s.check(rng(o, 0, 32), o.base, o) is None  # the first copy: nothing to compare
    assert s.check(rng(o, 0, 32), o.base, o) is None  # unchanged
    o.buf[5] = b"x"
    o.buf[9] = b"y"
    assert s.check(rng(o, 0, 32), o.base, o) == (E.PINNED, o.base + 5, 5)  # bytes 5..9
    assert s.check(rng(o, 0, 32), o.base, o) is None  # kept again after the comparison
    o.buf[6] = b"z"
    assert s.check(rng(o, 0, 32), o.base, o, itemsize=4) == (E.PINNED, o.base + 4, 4)  # whole elements


def test_only_the_bytes_the_previous_copy_read_are_compared():
    s, o = staging(), Owner(64)
    s.check(rng(o, 0, 8), o.base, o)
    o.buf[20] = b"x"  # not read by the copy
    assert s.check(rng(o, 0, 32), o.base, o) is None
    o.buf[20] = b"z"  # read by the copy of 32 bytes
    assert s.check(rng(o, 0, 16), o.base, o) == (E.PINNED, o.base + 20, 1)


def test_a_traced_write_or_a_new_allocation_forgets_the_bytes():
    s, o = staging(), Owner(64)
    s.check(rng(o, 0, 32), o.base, o)
    s.forget([(0, 0x1000, 16), rng(o, 30, 40)])  # a device range is ignored; the pinned one overlaps
    o.buf[3] = b"x"
    assert s.check(rng(o, 0, 32), o.base, o) is None
    s.forget([rng(o, 32, 64)])  # next to the kept bytes: they stay
    o.buf[4] = b"x"
    assert s.check(rng(o, 0, 32), o.base, o) == (E.PINNED, o.base + 4, 1)


def test_another_copy_reading_the_kept_bytes_forgets_them():
    """A write found later at the first place could have come before the other copy, which read it."""
    s, o = staging(), Owner(64)
    s.check(rng(o, 0, 32), o.base, o)
    s.check(rng(o, 16, 48), o.base, o)
    o.buf[2] = b"x"
    assert s.check(rng(o, 0, 32), o.base, o) is None


def test_disjoint_places_of_one_block_are_kept_apart():
    """A ring of slots in one pinned block: each slot is compared with its own previous copy."""
    s, o = staging(), Owner(64)
    for _ in range(2):
        assert s.check(rng(o, 0, 32), o.base, o) is None
        assert s.check(rng(o, 32, 64), o.base, o) is None
    o.buf[40] = b"x"
    assert s.check(rng(o, 0, 32), o.base, o) is None
    assert s.check(rng(o, 32, 64), o.base, o) == (E.PINNED, o.base + 40, 1)


def test_an_owner_that_died_or_changed_blocks_forgets_the_bytes():
    s, o = staging(), Owner(64)
    holder = Owner(0)
    holder.base = o.base  # holds the same memory, but dies: the block may be handed out again
    s.check(rng(o, 0, 32), o.base, holder)
    del holder
    o.buf[1] = b"x"
    assert s.check(rng(o, 0, 32), o.base, o) is None
    s.check(rng(o, 0, 32), o.base, o)
    o.base += 64  # the owner holds another block now (a storage swapped by set_)
    o.buf[2] = b"x"
    assert s.check((E.PINNED, ctypes.addressof(o.buf), 32), ctypes.addressof(o.buf), o) is None


def test_the_oldest_places_are_forgotten_first():
    s, o = staging(), Owner(8 * (MAX_BLOCKS + 1))
    for i in range(MAX_BLOCKS + 1):
        s.check(rng(o, 8 * i, 8 * i + 8), o.base, o)
    assert len(s.kept) == MAX_BLOCKS and o.base not in s.kept and o.base + 8 in s.kept


def test_large_and_strided_copies_are_not_kept():
    s, o = staging(), Owner(LIMIT + 64)
    assert s.check(rng(o, 0, LIMIT + 1), o.base, o) is None
    assert s.check((E.PINNED, o.base, 64, (4, (4,), (4,))), o.base, o) is None
    assert not s.kept


def test_owners_without_weak_references_are_not_kept():
    s = PinnedStaging(lambda owner: 0)
    buf = ctypes.create_string_buffer(16)
    s.check((E.PINNED, ctypes.addressof(buf), 16), ctypes.addressof(buf), 5)
    assert not s.kept


@given(st.binary(min_size=1, max_size=300), st.data())
def test_changed_span_is_the_smallest_covering_slice(old, data):
    new = bytearray(old)
    for i in data.draw(st.lists(st.integers(0, len(old) - 1), min_size=1, max_size=5)):
        new[i] = (new[i] + 1) % 256
    new = bytes(new)
    diffs = [i for i in range(len(old)) if old[i] != new[i]]
    assert changed_span(old, new) == (diffs[0], diffs[-1] + 1)


# ------------------------------------------------------------------ the torch tracer
torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.analysis.findings import HOST_DEVICE  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.host_memory import staged_write  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402
from tests.support.torch_kit import pin  # noqa: E402

SIDE = 1


@pytest.fixture
def traced():
    """(tracer, analyzer, pinned tensor, a NumPy view of it made before tracing)."""
    analyzer = Analyzer()
    tracer = TorchTracer(EventBuffer([analyzer.feed]))
    host = torch.zeros(16, dtype=torch.int32)
    view = host.numpy()
    tracer.buffer.events.append(E.stream(SIDE, 0, 0x1000))
    pin(tracer, host)
    tracer.start()
    try:
        yield tracer, analyzer, host, view
    finally:
        tracer.stop()


def h2d(tracer, t):
    """What the tracer does for ``gpu.copy_(t, non_blocking=True)`` on stream SIDE: the check, then the copy."""
    evs = tracer.buffer.events
    r = tracer.range_in(t, E.PINNED)
    staged_write(tracer, evs, t, r, 0, 0)
    evs.append(E.op(SIDE, "aten::copy_", reads=[r]))


def findings(analyzer):
    analyzer.finish()
    return [(f.kind, (f.previous.agent, f.previous.name), (f.current.agent, f.current.name), f.lo, f.hi)
            for f in analyzer.sorted_findings()]


def test_a_numpy_refill_before_the_copy_is_done_races(traced):
    tracer, analyzer, host, view = traced
    base = host.data_ptr()
    h2d(tracer, host[:8])
    view[2:4] = 7  # the next step's inputs, while the copy may still run: elements 2 and 3
    h2d(tracer, host[:8])
    tracer.stop()
    assert findings(analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, WRITE_SEEN), base + 8, base + 16)]


def test_a_refill_after_synchronizing_is_clean(traced):
    tracer, analyzer, host, view = traced
    h2d(tracer, host[:8])
    tracer.buffer.events.append(E.stream_sync(SIDE))
    view[2:4] = 7
    h2d(tracer, host[:8])
    tracer.stop()
    assert findings(analyzer) == []


def test_a_traced_write_is_checked_as_itself_not_again(traced):
    """``host.add_`` is a traced host write: it is the one reported, and the bytes it changed are not a second,
    untraced write at the next copy."""
    tracer, analyzer, host, view = traced
    h2d(tracer, host[:8])
    assert list(tracer.staged.kept) == [host.data_ptr()]
    host[:4].add_(1)
    assert not tracer.staged.kept
    h2d(tracer, host[:8])
    tracer.stop()
    assert [(k, cur[1]) for k, _p, cur, _lo, _hi in findings(analyzer)] == [(HOST_DEVICE, "aten::add_.Tensor")]


def test_the_report_explains_a_refill_it_did_not_see_happen():
    """Replayed from an H200 trace of a scheduler refilling a pinned buffer with ``ctypes.memmove`` (tokenspeed's
    overlapping scheduler): the report says the write was inferred and where to synchronize, not that a write
    happened on the copy's line."""
    from streamsan.replay import replay_trace
    from tests.support.fixtures import trace

    report = replay_trace(str(trace("real_world_programs/tokenspeed_overlap_fill_host_races_h2d")))
    (race,) = report["races"]
    assert (race["access"]["op"], race["access"]["type"], race["previous_access"]["op"]) == (
        E.UNTRACED_REFILL, "write", "aten::copy_")
    assert race["missing_edge"].startswith("The host rewrote bytes that aten::copy_ (read) at ")
    assert "outside any traced call" in race["missing_edge"]
    assert race["fix"].startswith("Call `torch.cuda.current_stream().synchronize()`")
    assert "before the host refills the buffer" in race["fix"]
