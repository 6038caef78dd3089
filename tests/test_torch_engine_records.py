"""The autograd engine records a gradient it hands to a consumer on another stream (in C++, unseen): the tracer
writes those records itself. Gradients are what the engine's backward formulas make (ops it runs without Python
frames); tensors made elsewhere (an unpack hook, the forward pass) are not recorded. CPU: tensors that say they
are CUDA tensors stand in for real ones, and the engine's bookkeeping is called as _dispatch calls it."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch import TorchTracer  # noqa: E402

ENGINE_STACK, HOOK_STACK, CONSUMER = 7, 8, 3


class OnCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 0


def cuda_like(n):
    return torch.zeros(n).as_subclass(OnCuda)


def base(t):
    return t.untyped_storage().data_ptr()


@pytest.fixture
def tracer():
    t = TorchTracer(EventBuffer())
    t._engine_sids.add(ENGINE_STACK)
    return t


def run(tracer, op, args, out, stack):
    evs = []
    tracer._engine_op(evs, tracer._plan(op), args, {}, out, CONSUMER, stack)
    return evs


def test_a_gradient_read_by_a_later_engine_op_is_recorded_on_its_stream(tracer):
    grad, other = cuda_like(4), cuda_like(4)
    assert run(tracer, torch.ops.aten.mul.Tensor, (other, other), grad, ENGINE_STACK) == []  # made: remembered
    out = cuda_like(4)
    assert run(tracer, torch.ops.aten.add.Tensor, (grad, other), out, ENGINE_STACK) == [
        (E.RECORD_STREAM, 0, base(grad), CONSUMER, ENGINE_STACK)]


def test_what_an_unpack_hook_makes_is_not_recorded(tracer):
    unpacked = cuda_like(4)
    run(tracer, torch.ops.aten.mul.Tensor, (cuda_like(4), cuda_like(4)), unpacked, HOOK_STACK)  # Python frames
    assert run(tracer, torch.ops.aten.cos.default, (unpacked,), cuda_like(4), ENGINE_STACK) == []


def test_a_freed_gradient_is_forgotten(tracer):
    """Through PyTorch's memory-free callback registry, as the CUDA allocator reports a free."""
    import torch.cuda._gpu_trace as gt

    from streamsan.tracers.torch import _GpuTrace

    grad = cuda_like(4)
    run(tracer, torch.ops.aten.mul.Tensor, (cuda_like(4), cuda_like(4)), grad, ENGINE_STACK)
    assert tracer._engine_grads == {base(grad)}
    _GpuTrace.install()
    _GpuTrace.active, tracer.tracing = tracer, True
    try:
        tracer.live_device[base(grad)] = 0
        gt.MemoryDeallocationCallbacks.fire_callbacks(base(grad))
    finally:
        _GpuTrace.active, tracer.tracing = None, False
    assert tracer._engine_grads == set()
    assert run(tracer, torch.ops.aten.cos.default, (grad,), cuda_like(4), ENGINE_STACK) == []
