"""What PyTorch does in C++ where a dispatch mode cannot see it, written as events by the tracer.

The autograd engine records a gradient it hands to a consumer on another stream: gradients are what the engine's
backward formulas make (ops it runs without Python frames); tensors made elsewhere (an unpack hook, the forward
pass) are not recorded. ``UntypedStorage.resize_`` allocates, copies and frees. CPU: tensors that say they are
CUDA tensors (and a stand-in storage) take the place of real ones, and the tracer's bookkeeping is called as its
dispatch calls it."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch import engine  # noqa: E402
from streamsan.tracers.torch.callbacks import on_alloc  # noqa: E402
from streamsan.tracers.torch.engine import ENGINE_CALLBACK, engine_stack  # noqa: E402
from streamsan.tracers.torch.patches import storage_resize  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402
from tests.support.torch_kit import cuda_like  # noqa: E402

ENGINE_STACK, HOOK_STACK, CONSUMER = 7, 8, 3




def base(t):
    return t.untyped_storage().data_ptr()


@pytest.fixture
def tracer():
    t = TorchTracer(EventBuffer())
    t.engine_stacks.add(ENGINE_STACK)
    return t


def run(tracer, op, args, out, stack):
    evs = []
    tracer.engine_op(evs, tracer.plan(op), args, {}, out, CONSUMER, stack)
    return evs


def test_a_gradient_read_by_a_later_engine_op_is_recorded_on_its_stream(tracer):
    grad, other = cuda_like(4), cuda_like(4)
    assert run(tracer, torch.ops.aten.mul.Tensor, (other, other), grad, ENGINE_STACK) == []  # made: remembered
    out = cuda_like(4)
    assert run(tracer, torch.ops.aten.add.Tensor, (grad, other), out, ENGINE_STACK) == [
        (E.RECORD_STREAM, 0, base(grad), CONSUMER, ENGINE_STACK)]


def test_a_gradient_in_a_list_argument_is_recorded(tracer):
    grad, other = cuda_like(4), cuda_like(4)
    run(tracer, torch.ops.aten.mul.Tensor, (other, other), grad, ENGINE_STACK)
    assert run(tracer, torch.ops.aten.cat.default, ([other, grad],), cuda_like(8), ENGINE_STACK) == [
        (E.RECORD_STREAM, 0, base(grad), CONSUMER, ENGINE_STACK)]


def test_a_gradient_a_hook_reads_is_not_recorded(tracer):
    """A hook's op (Python frames, no custom backward around it) reading a gradient on a stream of its own (a
    pipeline stage's boundary copy): the engine records nothing there."""
    grad, other = cuda_like(4), cuda_like(4)
    run(tracer, torch.ops.aten.mul.Tensor, (other, other), grad, ENGINE_STACK)
    assert run(tracer, torch.ops.aten.add.Tensor, (grad, other), cuda_like(4), HOOK_STACK) == []


def test_a_gradient_a_custom_backward_reads_is_recorded(tracer):
    grad, other = cuda_like(4), cuda_like(4)
    run(tracer, torch.ops.aten.mul.Tensor, (other, other), grad, ENGINE_STACK)
    got = {}

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            got["backward"] = run(tracer, torch.ops.aten.add.Tensor, (grad, other), cuda_like(4), HOOK_STACK)
            return g * 2

    x = torch.ones(3, requires_grad=True)
    y = Scale.apply(x)

    def hook(key):
        def read(_):
            got[key] = run(tracer, torch.ops.aten.add.Tensor, (grad, other), cuda_like(4), HOOK_STACK)
        return read

    y.register_hook(hook("hook"))
    x.register_post_accumulate_grad_hook(hook("post"))
    y.sum().backward()
    assert got == {"backward": [(E.RECORD_STREAM, 0, base(grad), CONSUMER, HOOK_STACK)], "hook": [], "post": []}


def test_an_engine_op_with_no_python_frame_below_the_tracer(tracer, monkeypatch):
    """An engine thread's op outside a node (DDP's reducer copying buckets into ``.grad`` at the end of backward)
    reaches the tracer with no Python frame below it: it reads a gradient, is no node's, and gets no record (before,
    looking for a custom backward two frames up raised, and tracing stopped at DDP's first backward)."""
    import _thread
    import collections
    import itertools
    import sys

    grad, other = cuda_like(4), cuda_like(4)
    run(tracer, torch.ops.aten.mul.Tensor, (other, other), grad, ENGINE_STACK)
    evs, errors = [], []
    monkeypatch.setattr(sys, "unraisablehook", errors.append)  # (where an error of such a thread goes)
    done = _thread.allocate_lock()
    done.acquire()
    call = (evs, tracer.plan(torch.ops.aten.copy_.default), (cuda_like(4), grad), {}, None, CONSUMER, HOOK_STACK)
    # _engine_op called from C, then the lock released from C: the thread's only Python frame is _engine_op's
    steps = itertools.chain(itertools.starmap(tracer.engine_op, [call]), itertools.starmap(done.release, [()]))
    _thread.start_new_thread(collections.deque, (steps, 0))
    assert done.acquire(timeout=10), [e.exc_value for e in errors]
    assert [e.exc_value for e in errors] == [] and evs == []


def test_what_an_unpack_hook_makes_is_not_recorded(tracer):
    unpacked = cuda_like(4)
    run(tracer, torch.ops.aten.mul.Tensor, (cuda_like(4), cuda_like(4)), unpacked, HOOK_STACK)  # Python frames
    assert run(tracer, torch.ops.aten.cos.default, (unpacked,), cuda_like(4), ENGINE_STACK) == []


def test_a_freed_gradient_is_forgotten(tracer):
    """Through PyTorch's memory-free callback registry, as the CUDA allocator reports a free."""
    import torch.cuda._gpu_trace as gt

    from streamsan.tracers.torch.callbacks import GpuTrace

    grad = cuda_like(4)
    run(tracer, torch.ops.aten.mul.Tensor, (cuda_like(4), cuda_like(4)), grad, ENGINE_STACK)
    assert tracer.engine_grads == {base(grad)}
    GpuTrace.install()
    GpuTrace.active, tracer.tracing = tracer, True
    try:
        tracer.live_device[base(grad)] = 0
        gt.MemoryDeallocationCallbacks.fire_callbacks(base(grad))
    finally:
        GpuTrace.active, tracer.tracing = None, False
    assert tracer.engine_grads == set()
    assert run(tracer, torch.ops.aten.cos.default, (grad,), cuda_like(4), ENGINE_STACK) == []


def test_a_storage_resize_allocates_copies_then_frees(tracer, monkeypatch):
    """FSDP's ``untyped_storage().resize_(n)``: no aten op; the tracer declares the new block (sized), the copy of
    the old bytes on the current stream, then the old block's free, whatever order the callbacks fired in."""
    import types

    from streamsan.tracers.torch import device

    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x1000)
    st = types.SimpleNamespace(device=types.SimpleNamespace(index=0), ptr=0x5000, n=64)
    st.data_ptr, st.nbytes = (lambda: st.ptr), (lambda: st.n)

    def orig(storage, size):  # the allocator: a new block, then the old one freed, as callbacks report them
        on_alloc(tracer, 0x9000)
        tracer.emit((E.FREE, 0, storage.ptr, 0))  # (as the free callback does)
        storage.ptr, storage.n = 0x9000, size

    tracer.tracing = True
    mark = len(tracer.buffer.events)
    storage_resize.resize(tracer, orig, st, 128)
    a = tracer.agent(0, 0x1000)
    evs = [ev for ev in tracer.buffer.events[mark:] if ev[0] not in (E.STREAM, E.DEF_STACK)]
    assert [ev[0] for ev in evs] == [E.ALLOC, E.OP, E.FREE]
    assert evs[0][1:5] == (0, 0x9000, 128, a) and evs[0][7] == "storage"
    assert evs[1][1:5] == (a, "UntypedStorage.resize_", ((0, 0x5000, 64),), ((0, 0x9000, 64),))
    assert evs[2][:3] == (E.FREE, 0, 0x5000)


def test_a_storage_resize_is_located_at_the_user_s_call(tracer, monkeypatch):
    """The resize's events carry the stack of the line that called ``resize_`` (through streamsan's own wrapper
    frame), not of that line's caller."""
    import inspect
    import types

    from streamsan.tracers.torch import device

    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x1000)
    st = types.SimpleNamespace(device=types.SimpleNamespace(index=0), ptr=0x5000, n=64)
    st.data_ptr, st.nbytes = (lambda: st.ptr), (lambda: st.n)

    def orig(storage, size):
        storage.ptr, storage.n = 0x9000, size

    wrapper = {}  # streamsan's resize_ wrapper stands between the user's line and _storage_resize
    exec(compile("def resize_(st, size):\n    return resize(tracer, orig, st, size)\n", storage_resize.__file__,
                 "exec"), {"tracer": tracer, "orig": orig, "resize": storage_resize.resize}, wrapper)
    tracer.tracing = True
    line = inspect.currentframe().f_lineno + 1
    wrapper["resize_"](st, 128)
    evs = tracer.buffer.events
    (op,) = [ev for ev in evs if ev[0] == E.OP]
    frames = next(ev[2] for ev in evs if ev[0] == E.DEF_STACK and ev[1] == op[5])
    assert frames[0][:2] == (__file__, line)


def test_an_engine_callback_between_nodes_is_named_with_its_backward_call(tracer, monkeypatch):
    """An op in an autograd engine thread with no node running is a callback queued for the end of the backward
    pass (DDP's reducer copying buckets into ``.grad``): its stack says so, then where ``backward()`` was called;
    in a thread the engine never ran a node in, there is nothing to say."""
    import threading

    from streamsan.analysis.locations import ENGINE_FRAME, location

    monkeypatch.setattr(engine, "current_autograd_node", lambda: None)
    tracer.backward_site = (("/src/train.py", 67, "main"),)
    assert engine_stack(tracer, []) == 0
    tracer.engine_threads.add(threading.get_ident())
    evs = []
    sid = engine_stack(tracer, evs)
    (define,) = [ev for ev in evs if ev[0] == E.DEF_STACK and ev[1] == sid]
    frames = tuple(tuple(f) for f in define[2])
    assert frames == ((ENGINE_FRAME, 0, ENGINE_CALLBACK), ("/src/train.py", 67, "main"))
    assert location(frames, "?") == "callback at the end of backward (backward() at /src/train.py:67)"
    assert sid not in tracer.engine_stacks  # (not a backward node: its outputs are no gradients handed on)
