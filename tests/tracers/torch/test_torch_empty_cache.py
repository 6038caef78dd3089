"""The torch tracer and ``torch.cuda.empty_cache()`` (CPU: stand-ins of the call and of the allocator's memory
snapshot): the bytes of the segments the call handed back to the driver become RELEASE events, the segments that
stay (split by a live block) none; and what the analyzer makes of them."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch import allocators  # noqa: E402
from streamsan.tracers.torch.patches.empty_cache import released_ranges  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402

MB = 1 << 20
SEG_A, SEG_B, SEG_C = 0x7F00_0000_0000, 0x7F00_0400_0000, 0x7F00_0800_0000


def seg(dev, address, size):
    return {"device": dev, "address": address, "total_size": size, "blocks": []}


@pytest.fixture
def allocator(monkeypatch):
    """A stand-in caching allocator: ``held`` is its segments; the stand-in of empty_cache drops ``drop``."""
    state = {"held": [seg(0, SEG_A, 2 * MB), seg(0, SEG_B, 20 * MB), seg(1, SEG_A, 2 * MB)], "drop": [], "calls": 0}

    def empty_cache():
        state["calls"] += 1
        state["held"] = [s for s in state["held"] if (s["device"], s["address"]) not in state["drop"]]

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda.memory, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: list(state["held"]))
    monkeypatch.setattr(allocators.ALLOCATOR, "unreported", False)
    return state


@pytest.fixture
def tracer(allocator):
    t = TorchTracer(EventBuffer([lambda events: None]))
    t.start()
    yield t
    t.stop()


def releases(t):
    return [ev[:4] for ev in t.buffer.events if ev[0] == E.RELEASE]


def test_released_segments_become_release_events(tracer, allocator):
    allocator["drop"] = [(0, SEG_B), (1, SEG_A)]
    torch.cuda.empty_cache()
    assert allocator["calls"] == 1
    assert releases(tracer) == [(E.RELEASE, 0, SEG_B, 20 * MB), (E.RELEASE, 1, SEG_A, 2 * MB)]
    torch.cuda.memory.empty_cache()  # (the same function, reached through torch.cuda.memory)
    assert allocator["calls"] == 2 and len(releases(tracer)) == 2  # nothing more went back


def test_a_segment_that_stays_is_not_released(tracer, allocator):
    torch.cuda.empty_cache()  # every segment split by a live block: none goes back
    assert allocator["calls"] == 1 and releases(tracer) == []


def test_an_unreporting_allocator_emits_nothing(tracer, allocator, monkeypatch):
    allocator["drop"] = [(0, SEG_A)]
    monkeypatch.setattr(allocators.ALLOCATOR, "unreported", True)
    torch.cuda.empty_cache()
    assert allocator["calls"] == 1 and releases(tracer) == []


def test_the_patch_is_undone(allocator):
    stand_in = torch.cuda.empty_cache
    t = TorchTracer(EventBuffer([lambda events: None]))
    t.start()
    assert torch.cuda.empty_cache is not stand_in and torch.cuda.empty_cache.__wrapped__ is stand_in
    t.stop()
    assert torch.cuda.empty_cache is stand_in and torch.cuda.memory.empty_cache is stand_in


def test_released_ranges_of_whole_and_unmapped_segments():
    before = [(0, 0x1000, 0x1000), (0, 0x4000, 0x4000), (1, 0x1000, 0x1000)]
    # the first segment stays whole; the second (expandable) keeps its middle pages; device 1's goes back
    after = [(0, 0x1000, 0x1000), (0, 0x5000, 0x1000)]
    assert released_ranges(before, after) == [(0, 0x4000, 0x1000), (0, 0x6000, 0x2000), (1, 0x1000, 0x1000)]
    assert released_ranges(before, before) == []


def test_the_analyzer_takes_a_release_as_the_end_of_pending_accesses(tracer, allocator):
    # a block of stream 1 read by stream 2 without record_stream, freed; empty_cache hands its segment back; the
    # next allocation of stream 1 finds nothing in flight (without the release: missing record_stream)
    base = [E.stream(1, 0, 0x10, 0, "s1"), E.stream(2, 0, 0x20, 0, "s2"), E.alloc(0, SEG_B, 4 * MB, 1),
            E.op(2, "aten::sum", reads=[(0, SEG_B, 4 * MB)]), E.free(0, SEG_B)]
    again = [E.alloc(0, SEG_B, 4 * MB, 1), E.op(1, "aten::fill_", writes=[(0, SEG_B, 4 * MB)])]
    allocator["drop"] = [(0, SEG_B)]
    torch.cuda.empty_cache()
    (rel,) = [ev for ev in tracer.buffer.events if ev[0] == E.RELEASE]
    for trace, kinds in ((base + again, ["missing-record-stream"]), (base + [rel] + again, [])):
        a = Analyzer()
        a.feed(trace)
        assert [f.kind for f in a.sorted_findings()] == kinds
