"""Ops implemented in Python (``torch.library.custom_op``, ``Library.impl``) run with the dispatch mode on: their
ops are traced where they run (on a GPU, the stream the implementation switches to), not the custom op as one
op on the caller's stream by its schema. CPU only: a pinned block registered by hand, written by a copy on
stream SIDE that nothing waits for; the implementations read it."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.analysis.findings import HOST_DEVICE  # noqa: E402
from streamsan.tracers.torch.rules import OpPlan  # noqa: E402
from tests.support.torch_kit import SIDE, findings_after, pin, pinned_after_copy, traced_after_copy  # noqa: E402



@torch.library.custom_op("streamsan_test::double_it", mutates_args=())
def double_it(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("streamsan_test::bump_", mutates_args=("x",), device_types="cpu")
def bump_(x: torch.Tensor) -> None:
    x.add_(1)


@torch.library.custom_op("streamsan_test::refuse", mutates_args=())
def refuse(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("refused")


@torch.library.custom_op("streamsan_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    with torch._C._DisableTorchDispatch():  # (work the tracer cannot see: a pybind extension's kernel)
        return x * 3


@torch.library.custom_op("streamsan_test::opaque_into", mutates_args=("out",))
def opaque_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out[2:].zero_()  # seen; the rest is not
    with torch._C._DisableTorchDispatch():
        out[:2].copy_(x[:2])


_LIB = torch.library.Library("streamsan_test", "FRAGMENT")
_LIB.define("halve(Tensor x) -> Tensor")
_LIB.impl("halve", lambda x: x / 2, "CPU")


# (tracer, analyzer, pinned tensor): its memory was just written by a copy on stream SIDE
traced = pytest.fixture(traced_after_copy, name="traced")


@pytest.mark.parametrize("call, inner", [
    (lambda t: torch.ops.streamsan_test.double_it(t[:4]), "aten::mul.Tensor"),
    (lambda t: torch.ops.streamsan_test.bump_(t[:4]), "aten::add_.Tensor"),
    (lambda t: torch.ops.streamsan_test.halve(t[:4]), "aten::div.Tensor"),
])
def test_the_ops_inside_a_python_implementation_are_traced(traced, call, inner):
    tracer, analyzer, host = traced
    call(host)
    base = host.untyped_storage().data_ptr()
    assert findings_after(tracer, analyzer) == [(HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, inner), base, base + 16)]


def test_an_implementation_whose_work_is_not_seen_is_one_access_by_its_schema(traced):
    """flash-attn's custom ops wrap a pybind extension: without the op's own access its kernel would be lost."""
    tracer, analyzer, host = traced
    torch.ops.streamsan_test.opaque(host[:4])
    base = host.untyped_storage().data_ptr()
    assert findings_after(tracer, analyzer) == [
        (HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "streamsan_test::opaque"), base, base + 16)]


def test_an_implementation_that_writes_its_outputs_only_in_part_is_one_access_too(traced):
    tracer, analyzer, host = traced
    out = torch.zeros(4)
    pin(tracer, out, what="float32[4]")
    torch.ops.streamsan_test.opaque_into(host[4:8], out)
    base = host.untyped_storage().data_ptr()
    assert findings_after(tracer, analyzer) == [
        (HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "streamsan_test::opaque_into"), base + 16, base + 32)]


def test_an_implementation_that_raises_raises_as_without_streamsan(traced):
    tracer, analyzer, host = traced
    with pytest.raises(ValueError, match="refused"):
        torch.ops.streamsan_test.refuse(host)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="invalid for input of size"):
        host.reshape(5, 3)  # (inside a composite kernel)
    assert tracer.tracing and not tracer.stopped_on_bug


@pytest.mark.parametrize("op, keys", [
    (lambda: torch.ops.streamsan_test.double_it.default, ("CompositeExplicitAutograd", "CompositeExplicitAutograd")),
    (lambda: torch.ops.streamsan_test.bump_.default, (None, "CPU")),
    (lambda: torch.ops.streamsan_test.halve.default, (None, "CPU")),
    (lambda: torch.ops.aten.mul.Tensor, None),  # PyTorch's own: C++
])
def test_which_kernels_are_python(op, keys):
    got = OpPlan(op()).python_kernel
    assert (None if got is None else tuple(k.name if k is not None else None for k in got)) == keys


def test_flushes_inside_the_implementation_are_seen_through():
    """The buffer hands its events to the analysis while the implementation runs (here after every op): the ops
    it traced are still found, and the custom op is no access of its own."""
    tracer, analyzer, host = pinned_after_copy(batch=1)
    tracer.start()
    torch.ops.streamsan_test.double_it(host[:4])
    assert tracer.buffer.consumers == [analyzer.feed]  # (the tap is gone)
    base = host.untyped_storage().data_ptr()
    assert findings_after(tracer, analyzer) == [
        (HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "aten::mul.Tensor"), base, base + 16)]


def test_on_a_wrapper_subclass_the_subclass_runs_the_op(traced):
    """DTensor-like wrappers dispatch a custom op themselves (sharding rules): the op is one access of their inner
    tensors, as for any op on them, and its implementation is not run around them."""
    from torch.testing._internal.two_tensor import TwoTensor

    tracer, analyzer, host = traced
    torch.ops.streamsan_test.double_it(TwoTensor(host[:4], torch.zeros(4)))
    base = host.untyped_storage().data_ptr()
    assert findings_after(tracer, analyzer) == [
        (HOST_DEVICE, (SIDE, "aten::copy_"), (E.HOST, "streamsan_test::double_it"), base, base + 16)]
