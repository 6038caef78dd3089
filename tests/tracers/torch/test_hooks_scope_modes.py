"""The hooks scope's dispatch modes (CPU): each thread enters its own mode at its outermost hooked region, the same
one again at its next region, and a region's end leaves that thread's mode, whatever other threads do meanwhile."""

import threading

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: E402

from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.dispatch import TracingMode  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402


def hooks_tracer():
    tracer = TorchTracer(EventBuffer(), scope="hooks")
    tracer.running = tracer.tracing = True  # (started by hand: no patches, nothing else switched on)
    return tracer


def test_one_mode_per_thread_entered_again_at_each_region_and_nested_regions_add_none():
    tracer = hooks_tracer()
    seen = []
    for _ in range(2):
        outer = tracer.push_context("region")
        inner = tracer.push_context("inner region")
        seen.append(_get_current_dispatch_mode())
        assert tracer.in_scope == 1 and len(tracer.modes) == 1
        tracer.pop_context(inner)
        assert isinstance(_get_current_dispatch_mode(), TracingMode)  # (the inner end leaves the mode on)
        tracer.pop_context(outer)
        assert _get_current_dispatch_mode() is None and tracer.in_scope == 0 and tracer.modes == []
    assert seen[0] is seen[1] and isinstance(seen[0], TracingMode)


def test_a_regions_end_leaves_its_own_threads_mode_while_another_thread_is_in_a_region():
    tracer = hooks_tracer()
    entered, a_left = threading.Event(), threading.Event()
    result = {}

    def other_thread():
        prev = tracer.push_context("other thread's region")
        result["other"] = _get_current_dispatch_mode()
        entered.set()
        a_left.wait(10)
        result["other still on"] = _get_current_dispatch_mode() is result["other"]
        tracer.pop_context(prev)
        result["other after"] = _get_current_dispatch_mode()

    prev = tracer.push_context("this thread's region")
    mine = _get_current_dispatch_mode()
    t = threading.Thread(target=other_thread)
    t.start()
    assert entered.wait(10)
    assert tracer.in_scope == 2 and len(tracer.modes) == 2
    tracer.pop_context(prev)  # this thread entered first and leaves first: its own mode goes, not the other's
    assert _get_current_dispatch_mode() is None
    assert tracer.modes == [result["other"]] and tracer.in_scope == 1
    a_left.set()
    t.join(10)
    assert result["other"] is not mine and result["other still on"] and result["other after"] is None
    assert tracer.modes == [] and tracer.in_scope == 0


def test_a_region_that_ends_after_the_tracer_stopped_leaves_nothing_behind():
    tracer = hooks_tracer()
    prev = tracer.push_context("region")
    tracer.stop()
    assert _get_current_dispatch_mode() is None
    tracer.pop_context(prev)  # (its mode was left by stop())
    assert tracer.modes == [] and _get_current_dispatch_mode() is None
