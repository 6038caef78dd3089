"""Host reads that launch no aten op: ``Tensor.tolist()``, ``Tensor.numpy()`` and ``np.asarray(tensor)`` on
pinned memory. CPU only: the tensor is registered as a pinned block by hand, and the device-to-host copy that
filled it is the event the tracer emits for a non-blocking D2H copy on a GPU."""

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from streamsan import events as E  # noqa: E402
from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.analysis.findings import HOST_DEVICE  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402
from tests.support.torch_kit import SIDE, pin, traced_after_copy  # noqa: E402


# (tracer, analyzer, pinned tensor): its memory was just written by a copy on stream SIDE
traced = pytest.fixture(traced_after_copy, name="traced")


def finding(analyzer):
    analyzer.finish()
    return [(f.kind, (f.previous.agent, f.previous.name), (f.current.agent, f.current.name), f.lo, f.hi)
            for f in analyzer.sorted_findings()]


@pytest.mark.parametrize("read, name, elements", [
    (lambda t: t[4:8].tolist(), "Tensor.tolist", (4, 8)),
    (lambda t: t.numpy(), "Tensor.numpy", (0, 16)),
    (lambda t: np.asarray(t[2:3]), "Tensor.numpy", (2, 3)),
])
def test_a_host_read_of_an_unsynchronized_d2h_copy_races(traced, read, name, elements):
    tracer, analyzer, host = traced
    values = read(host)
    assert list(np.asarray(values, dtype=np.float32).ravel()) == list(range(*elements))  # unchanged results
    tracer.stop()
    base = host.untyped_storage().data_ptr()
    lo, hi = (base + 4 * e for e in elements)
    assert finding(analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, name), lo, hi)]


def test_after_the_stream_is_synchronized_the_read_is_clean(traced):
    tracer, analyzer, host = traced
    tracer.buffer.events.append(E.stream_sync(SIDE))
    host.tolist()
    host.numpy()
    tracer.stop()
    assert finding(analyzer) == []


def test_pageable_tensors_and_untraced_calls_emit_nothing(traced):
    tracer, analyzer, host = traced
    torch.ones(4).tolist()  # not pinned
    tracer.stop()
    host.tolist()  # after stop: the patches are gone
    assert "numpy" not in torch.Tensor.__dict__ and "tolist" not in torch.Tensor.__dict__
    assert finding(analyzer) == []


def test_a_call_that_raises_reads_nothing(traced):
    tracer, analyzer, host = traced
    with pytest.raises(RuntimeError):
        host.requires_grad_().numpy()  # PyTorch refuses: no read happened
    tracer.stop()
    assert finding(analyzer) == []


def test_a_numpy_view_read_after_the_synchronization_is_clean(traced):
    """vLLM's asynchronous outputs: the view is made while the copy runs and read after waiting for it."""
    tracer, analyzer, host = traced
    view = host.numpy()
    tracer.buffer.events.append(E.stream_sync(SIDE))
    assert view.sum() == sum(range(16))
    del view
    tracer.stop()
    assert finding(analyzer) == []


def test_a_numpy_view_gone_before_the_synchronization_races(traced):
    tracer, analyzer, host = traced
    assert np.asarray(host).sum() == sum(range(16))  # the array is gone at the end of this line
    tracer.buffer.events.append(E.stream_sync(SIDE))
    tracer.stop()
    base = host.untyped_storage().data_ptr()
    assert finding(analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "Tensor.numpy"), base, base + 64)]


def test_a_view_of_the_view_keeps_the_read_open(traced):
    tracer, analyzer, host = traced
    part = host.numpy()[4:8]  # the base array lives on through this slice
    tracer.buffer.events.append(E.stream_sync(SIDE))
    assert list(part) == [4, 5, 6, 7]
    del part
    tracer.stop()
    assert finding(analyzer) == []


def test_torch_save_reads_the_pinned_tensors_it_writes(traced):
    import io

    tracer, analyzer, host = traced
    buf = io.BytesIO()
    torch.save({"step": 3, "state": [host[:4], torch.ones(2)]}, buf)
    tracer.stop()
    assert torch.load(io.BytesIO(buf.getvalue()))["state"][0].tolist() == [0, 1, 2, 3]
    base = host.untyped_storage().data_ptr()
    assert finding(analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "torch.save"), base, base + 16)]
    assert torch.save.__module__ == "torch.serialization" and not hasattr(torch.save, "__wrapped__")


def test_an_op_on_a_wrapper_subclass_accesses_its_inner_tensors(traced):
    """DTensor-like wrappers: the dispatch mode sees the op on the wrapper, not the inner ops it runs."""
    from torch.testing._internal.two_tensor import TwoTensor

    tracer, analyzer, host = traced
    w = TwoTensor(host[4:8], torch.zeros(16)[4:8])  # the second inner tensor is pageable: not followed
    w.mul_(2)
    tracer.stop()
    assert host[4:8].tolist() == [8, 10, 12, 14]
    base = host.untyped_storage().data_ptr()
    assert finding(analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "aten::mul_.Tensor"), base + 16,
                                  base + 32)]


# ------------------------------------------------------------------ views that see each access when it happens
@pytest.fixture
def written(traced):
    """As ``traced`` (its pinned tensor just written by an asynchronous copy)."""
    return traced


def test_a_view_made_before_the_copies_sees_the_reads_after_them():
    """vLLM's input batches make ``t.numpy()`` views of their pinned tensors once, at start; the non-blocking
    device-to-host copies come later, each step, and the host reads the view in the next step. The view lives
    to the end of the program (its read at death comes after the last synchronization): only a read seen when
    it happens can be found."""
    analyzer = Analyzer()
    tracer = TorchTracer(EventBuffer([analyzer.feed]))
    host = torch.zeros(16, dtype=torch.float32)
    st = host.untyped_storage()
    base = st.data_ptr()
    tracer.buffer.events.append(E.stream(SIDE, 0, 0x1000))
    pin(tracer, host, what="float32[16]")
    tracer.start()
    try:
        view = host.numpy()  # made before any copy writes the memory
        copy = E.op(SIDE, "aten::copy_", writes=[E.rng(E.PINNED, base, st.nbytes())])
        tracer.buffer.events.append(copy)  # step 1's copy into the pinned tensor
        accepted = view[:4] - 1  # step 2 reads it: no synchronization in between
        tracer.buffer.events.append(copy)
        tracer.buffer.events.append(E.stream_sync(SIDE))
        view[4:8] += 1  # after the synchronization: clean
    finally:
        tracer.stop()
    assert accepted.tolist() == [-1.0] * 4
    assert finding(analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "numpy.subtract"), base, base + 16)]


def test_such_views_report_each_read_when_it_happens(written):
    """The view outlives a later synchronization: its read before it is found (reads are seen as they happen)."""
    from streamsan.tracers.pinned_numpy import pinned_class

    tracer, analyzer, host = written
    view = host.numpy()
    assert isinstance(view, pinned_class()) and isinstance(view, np.ndarray)
    assert float(view[4:8].sum()) == 22.0  # read before the copy is known to be done
    tracer.buffer.events.append(E.stream_sync(SIDE))
    assert view.tolist() == list(range(16))  # after it: fine
    del view
    tracer.stop()
    base = host.untyped_storage().data_ptr()
    assert finding(analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "numpy.add.reduce"), base + 16,
                                  base + 32)]


def test_such_views_read_after_the_synchronization_are_clean(written):
    tracer, analyzer, host = written
    view = host.numpy()
    tracer.buffer.events.append(E.stream_sync(SIDE))
    assert int(view.argmax()) == 15 and view[3] == 3
    np.asarray(host).sum()  # a plain array over the view: read when gone, after the synchronization
    del view
    tracer.stop()
    assert finding(analyzer) == []


def test_such_views_behave_as_arrays_once_tracing_stops(written):
    import pickle

    tracer, analyzer, host = written
    view = host.numpy()
    tracer.stop()
    assert type(pickle.loads(pickle.dumps(view))) is np.ndarray
    assert float((view + 1).sum()) == sum(range(1, 17))
    assert torch.from_numpy(view).sum().item() == sum(range(16))


@pytest.mark.parametrize("read", [
    lambda v: int(v.argmax()), lambda v: v.argsort()[0], lambda v: list(v), lambda v: repr(v), lambda v: str(v),
    lambda v: float(v[3, ...]), lambda v: v.take([1, 2]), lambda v: 5 in v, lambda v: f"{v[2:3]}",
], ids=["argmax", "argsort", "iter", "repr", "str", "float", "take", "contains", "format"])
def test_methods_without_ufuncs_are_reads_too(written, read):
    tracer, analyzer, host = written
    view = host.numpy()
    read(view)
    tracer.buffer.events.append(E.stream_sync(SIDE))
    del view
    tracer.stop()
    (got,) = finding(analyzer)
    assert got[0] == HOST_DEVICE and got[2][1].startswith("numpy.ndarray.")


def test_repr_of_such_a_view_is_a_plain_arrays(written):
    tracer, analyzer, host = written
    assert repr(host[:3].numpy()) == "array([0., 1., 2.], dtype=float32)"


def test_a_bug_of_streamsans_in_a_views_access_does_not_reach_the_program(written, monkeypatch):
    tracer, analyzer, host = written
    view = host.numpy()

    def broken(arr):
        raise RuntimeError("dictionary changed size during iteration")

    monkeypatch.setattr(tracer, "pinned_range", broken)
    assert float(view.sum()) == sum(range(16)) and view.tolist()[:2] == [0.0, 1.0]
