"""Composite ops in inference mode. There PyTorch hands ``to``, ``reshape``, ``contiguous``, ``flatten``,
``dropout``, ``type_as``... to the dispatch mode whole (elsewhere they decompose before it), and their schemas do
not say whether they copy: ``x.to("cpu", non_blocking=True)`` is a device-to-host copy, ``F.dropout(x,
training=False)`` returns ``x`` itself. The tracer runs their decomposition and sees the copies they make.
CPU only: a pinned block registered by hand, written by a copy on stream SIDE that nothing waits for."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.analysis.findings import HOST_DEVICE  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.rules import OpPlan  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402
from tests.support.torch_kit import SIDE, findings_after, pinned_after_copy, traced_after_copy  # noqa: E402



# (tracer, analyzer, pinned tensor): its memory was just written by a copy on stream SIDE
traced = pytest.fixture(traced_after_copy, name="traced")


@pytest.mark.parametrize("convert, op, elements", [
    (lambda t: t.to(torch.float64), "aten::_to_copy", (0, 16)),
    (lambda t: t[4:8].to(dtype=torch.int32, copy=True), "aten::_to_copy", (4, 8)),
    (lambda t: t.view(4, 4).t().reshape(16), "aten::clone", (0, 16)),
    (lambda t: t.view(4, 4)[:, :2].contiguous(), "aten::clone", (0, 14)),
    (lambda t: t.view(4, 4).t().flatten(), "aten::clone", (0, 16)),
    (lambda t: t.type_as(torch.zeros(1, dtype=torch.float16)), "aten::_to_copy", (0, 16)),
])
def test_a_copying_composite_op_reads_its_input(traced, convert, op, elements):
    tracer, analyzer, host = traced
    with torch.inference_mode():
        out = convert(host)
    assert out.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()  # (a copy indeed)
    base = host.untyped_storage().data_ptr()
    lo, hi = (base + 4 * e for e in elements)
    assert findings_after(tracer, analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, op), lo, hi)]


@pytest.mark.parametrize("keep", [
    lambda t: t.to(torch.float32),
    lambda t: t.reshape(4, 4),
    lambda t: t.contiguous(),
    lambda t: t.flatten(),
    lambda t: torch.nn.functional.dropout(t, 0.5, training=False),
    lambda t: torch.nn.functional.dropout(t, 0.0, training=True),
    lambda t: t.type_as(t),
    lambda t: torch.atleast_2d(t),
    lambda t: torch.cartesian_prod(t),
    lambda t: torch.conj_physical(t),
    lambda t: torch.unsafe_chunk(t, 2)[1],
    lambda t: torch.broadcast_tensors(t, torch.zeros(3, 1))[0],
    lambda t: torch.meshgrid(t, indexing="ij")[0],
])
def test_a_composite_op_that_returns_its_input_touches_nothing(traced, keep):
    """Before: ``dropout`` and ``type_as`` (fresh results by their schemas) read their input and wrote it. The
    list is what PyTorch's op database's samples show in inference mode (tests/tracers/torch/test_torch_schema_audit.py):
    composite ops whose result is their input, or a view of it, though their schema says new memory."""
    tracer, analyzer, host = traced
    with torch.inference_mode():
        out = keep(host)
    assert out.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    assert findings_after(tracer, analyzer) == []


def test_unsafe_split_is_views(traced):
    """``torch.unsafe_chunk`` outside inference mode: ``unsafe_split`` returns views of its input (no kernel),
    though its schema says new tensors."""
    tracer, analyzer, host = traced
    parts = torch.unsafe_chunk(host, 4)
    assert parts[3].untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    assert findings_after(tracer, analyzer) == []


def test_outside_inference_mode_the_same_ops_give_the_same_findings(traced):
    tracer, analyzer, host = traced
    host.view(4, 4).t().reshape(16)
    torch.nn.functional.dropout(host, 0.5, training=False)
    base = host.untyped_storage().data_ptr()
    assert findings_after(tracer, analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "aten::clone"), base,
                                           base + 64)]


def test_an_error_inside_a_decomposition_is_the_programs():
    tracer = TorchTracer(EventBuffer([]))
    tracer.start()
    try:
        with torch.inference_mode(), pytest.raises(RuntimeError, match="invalid for input of size"):
            torch.zeros(6).reshape(4, 4)
        assert tracer.tracing  # (not taken for a bug of streamsan's)
    finally:
        tracer.stop()


@pytest.mark.parametrize("op, decomposed", [
    (torch.ops.aten.to.dtype_layout, True), (torch.ops.aten.to.other, True), (torch.ops.aten.reshape.default, True),
    (torch.ops.aten.contiguous.default, True), (torch.ops.aten.dropout.default, True),
    (torch.ops.aten.type_as.default, True), (torch.ops.aten.pin_memory.default, True),
    (torch.ops.aten._to_copy.default, False), (torch.ops.aten.view.default, False),  # not composite
    (torch.ops.aten.linear.default, False), (torch.ops.aten.matmul.default, False),  # composite, always new memory
])
def test_which_ops_run_through_their_decomposition(op, decomposed):
    plan = OpPlan(op)
    assert (plan.decompose is not None) is decomposed
    assert (plan.fast[0] == 0) if decomposed else True  # the C tracer leaves them to the Python path


def test_batch_norm_in_training_writes_its_running_statistics(traced):
    """``batch_norm``'s schema says nothing of its writes to the running statistics; its decomposition does."""
    tracer, analyzer, host = traced
    with torch.inference_mode():
        torch.nn.functional.batch_norm(torch.randn(4, 8), host[:8], host[8:], training=True)
    base = host.untyped_storage().data_ptr()
    got = findings_after(tracer, analyzer)
    assert [(k, prev, cur[0], lo - base, hi - base) for k, prev, cur, lo, hi in got] == [
        (HOST_DEVICE, (SIDE, "aten::copy_"), E.HOST, 0, 64)]
    assert got[0][2][1] in ("aten::native_batch_norm", "aten::_native_batch_norm_legit")


@pytest.mark.parametrize("training, expected", [(True, [("aten::native_batch_norm", 0, 64)]), (False, [])])
def test_batch_norm_writes_the_running_statistics_only_in_training(training, expected):
    """Outside inference mode too: a copy on SIDE reads the statistics (a checkpoint); the host's batch norm then
    updates them in training (a write the kernel's schema does not annotate), and only reads them in eval."""
    tracer, analyzer, stats = pinned_after_copy(copy_writes=False)
    tracer.start()
    torch.nn.functional.batch_norm(torch.randn(4, 8), stats[:8], stats[8:], training=training)
    base = stats.untyped_storage().data_ptr()
    got = findings_after(tracer, analyzer)
    assert [(cur[1], lo - base, hi - base) for _k, _prev, cur, lo, hi in got] == expected
    assert all(k == HOST_DEVICE and prev == (SIDE, "aten::copy_") for k, prev, _c, _lo, _hi in got)
