"""The torch and the CuPy tracer are what a session, the library hooks and pinned NumPy views take a tracer for
(``streamsan/tracers/protocol.py``)."""

import pytest

torch = pytest.importorskip("torch")

from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.cupy.tracer import CupyTracer  # noqa: E402
from streamsan.tracers.protocol import PinnedMemoryOwner, Tracer  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402


def test_the_torch_tracer_is_a_tracer_and_a_pinned_memory_owner():
    tracer = TorchTracer(EventBuffer([]))
    assert isinstance(tracer, Tracer) and isinstance(tracer, PinnedMemoryOwner)


def test_the_cupy_tracer_is_a_tracer_and_a_pinned_memory_owner():
    tracer = CupyTracer(EventBuffer([]))  # (CuPy is imported only when it starts)
    assert isinstance(tracer, Tracer) and isinstance(tracer, PinnedMemoryOwner)


def test_a_session_takes_its_torch_tracer_for_one():
    import streamsan

    with streamsan.watch() as s:
        assert all(isinstance(t, Tracer) for t in s.tracers.values())
        assert "torch" in s.tracers
