"""A bug of streamsan's own in the dispatch path must not break the traced program: the op still runs once and
returns its result, tracing stops, and a note says why. An error of the op itself reaches the program unchanged.
CPU: the tensors are registered as pinned memory so that ops take the tracer's host-access path."""

import logging

import pytest

torch = pytest.importorskip("torch")

from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402


@pytest.fixture
def tracer():
    t = TorchTracer(EventBuffer())
    t.notes = []
    t.on_note = t.notes.append
    x = torch.arange(4.0)
    st = x.untyped_storage()
    t.pinned[st.data_ptr()] = st.nbytes()
    t.x = x
    t.start()
    yield t
    t.stop()


def broken(*a, **k):
    raise ValueError("a streamsan bug")


def test_a_bug_before_the_op_runs_it_untraced(tracer, monkeypatch, caplog):
    monkeypatch.setattr(tracer.stacks, "capture", broken)
    with caplog.at_level(logging.ERROR, logger="streamsan"):
        y = tracer.x.mul(2)  # the bug strikes before the op runs
    assert y.tolist() == [0, 2, 4, 6]
    assert tracer.tracing is False
    assert len(tracer.notes) == 1 and "internal error" in tracer.notes[0] and "a streamsan bug" in tracer.notes[0]
    assert "a streamsan bug" in caplog.text


def test_a_bug_after_the_op_returns_its_result_without_running_it_again(tracer, monkeypatch):
    monkeypatch.setattr(tracer.buffer, "batch", 0)  # the op's event is flushed right after the op, and that fails
    monkeypatch.setattr(tracer.buffer, "flush", broken)
    y = tracer.x.add_(1)  # in place: running it twice would show
    assert y is tracer.x and tracer.x.tolist() == [1, 2, 3, 4]
    assert tracer.tracing is False and len(tracer.notes) == 1


def test_the_ops_own_error_reaches_the_program(tracer):
    with pytest.raises(RuntimeError, match="size of tensor"):
        tracer.x.add(torch.ones(3))
    assert tracer.tracing is True and tracer.notes == []


def test_a_bug_in_a_patched_method_leaves_its_result(tracer, monkeypatch):
    """The patches of tolist(), numpy(), torch.save and query(): the program gets what the method returns."""
    import io

    from streamsan.tracers.torch.patches import host_reads

    monkeypatch.setattr(host_reads, "host_read", broken)
    assert tracer.x.tolist() == [0, 1, 2, 3]
    assert tracer.tracing is False and len(tracer.notes) == 1 and "Tensor.tolist" in tracer.notes[0]
    tracer.tracing = True
    torch.save({"x": tracer.x}, io.BytesIO())  # the same bug: one note only
    assert len(tracer.notes) == 1


def test_a_session_whose_tracer_stopped_is_incomplete(monkeypatch):
    """The events after the stop are missing: the session and its report say incomplete, and why (before, the
    report claimed to be complete, and a clean result after such a stop looked like a clean program)."""
    import streamsan
    from streamsan import events as E

    with streamsan.watch() as s:
        tracer = s.tracers["torch"]
        x = torch.arange(4.0)
        st = x.untyped_storage()
        tracer.pinned[st.data_ptr()] = st.nbytes()
        monkeypatch.setattr(tracer.stacks, "capture", broken)
        assert x.mul(2).tolist() == [0, 2, 4, 6]
    assert s.complete is False
    rep = s.report()
    assert rep["complete"] is False
    stopped = [p for p in rep["problems"] if p.startswith(E.TRACING_STOPPED)]  # (also: no CUDA device here)
    assert len(stopped) == 1 and "at aten.mul.Tensor (ValueError: a streamsan bug)" in stopped[0]
