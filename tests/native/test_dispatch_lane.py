"""The dispatch lane (``streamsan/native/lane.cpp``, ``streamsan/tracers/torch/lane.py``): the tracer's ops reach
its C core without PyTorch's Python dispatch, with the same events, and Python code never meets the lane.

On the CPU stand-in (CPU tensors play CUDA's part). An announcing mode pushed before the tracer starts stands for
CUDA's allocator: it runs below the tracer (the lane's ops reach it as they reach the GPU) and announces each fresh
output as an allocation through PyTorch's GPU trace registries, inside the op, as CUDA's allocator does.
"""

import contextlib
import threading

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
)

from streamsan import events as E  # noqa: E402
from streamsan.agents import StreamRegistry  # noqa: E402
from streamsan.native import observer  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.stacks import StackTable  # noqa: E402
from streamsan.tracers.torch import lane  # noqa: E402
from streamsan.tracers.torch.callbacks import GpuTrace  # noqa: E402
from streamsan.tracers.torch.dispatch import TracingMode  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402
from tests.native.test_ctracer import canonical, program  # noqa: E402
from tests.support.standin import cpu_as_cuda, fire  # noqa: E402

module, why = observer.load()
needs_lane = pytest.mark.skipif(module is None or not getattr(module, "LANE", 0),
                                reason=f"the dispatch lane is not built here: {why}")
pytestmark = needs_lane


class Announcing(TorchDispatchMode):
    """Below the tracer: runs each op and announces its new output storages as allocations (keeping the outputs,
    so that no address is reused)."""

    def __init__(self):
        super().__init__()
        self.kept = []
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                p = t.untyped_storage().data_ptr()
                if p and p not in self.seen:
                    self.seen.add(p)
                    self.kept.append(t)
                    fire("alloc", p)
        return out


@contextlib.contextmanager
def traced(monkeypatch, core=""):
    """A tracer on the stand-in with the lane where ``core`` is "" (``STREAMSAN_CORE`` otherwise): yields (tracer,
    the events it made, the lane's answer to attach)."""
    monkeypatch.setenv("STREAMSAN_CORE", core)
    got = []
    allocator = Announcing()
    with cpu_as_cuda(), allocator:
        GpuTrace.install()
        buf = EventBuffer([got.extend])
        tr = TorchTracer(buf, StreamRegistry(buf), StackTable())
        tr.running = tr.tracing = True
        GpuTrace.attach(tr)
        answer = lane.attach(tr, TracingMode)
        tr.enter_mode()
        try:
            yield tr, got, answer
        finally:
            lane.detach(tr)
            while tr.modes:
                tr.modes.pop().__exit__(None, None, None)
            GpuTrace.detach(tr)
            buf.flush()


def backward_program():
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    (x @ w).relu().sum().backward()
    return [x, w, x.grad, w.grad]


def run(monkeypatch, core):
    with traced(monkeypatch, core) as (tr, got, answer):
        before = lane.handled()
        kept = [program() for _ in range(3)] + [backward_program() for _ in range(2)]
        after = lane.handled()
    return canonical(got), (after[0] - before[0], after[1] - before[1]), answer, kept


def test_the_lane_makes_the_events_the_mode_makes(monkeypatch):
    (with_lane, (handled, passed), answer, _), (without, counts, off, _) = [
        run(monkeypatch, core) for core in ("", "c")]  # (one call site: the same stacks)
    assert answer == "" and off == "STREAMSAN_CORE=c"
    assert counts == (0, 0)
    assert len(with_lane) > 200 and with_lane == without
    assert any(ev[0] == E.ALLOC for ev in with_lane)  # (the allocations announced inside ops were placed)
    # the lane did the work: it passed down only the ops the core leaves to Python and each op's first call
    assert handled > passed > 0


def test_python_code_never_meets_the_lane(monkeypatch):
    with traced(monkeypatch) as (tr, got, answer):
        assert answer == ""
        assert module.lane_modes() == [False, False, True]  # the announcing mode, the TracingMode, the lane
        assert torch._C._len_torch_dispatch_stack() == 2
        stack = _get_current_dispatch_mode_stack()
        assert [type(m) for m in stack] == [Announcing, TracingMode]
        assert isinstance(_get_current_dispatch_mode(), TracingMode)
        assert module.lane_modes() == [False, False, True]  # (put back after each look)
        with _disable_current_modes():  # pops every mode, pushes them back after
            assert module.lane_modes() == []
            torch.ones(3) + 1  # not traced
        assert module.lane_modes() == [False, False, True]
        before = lane.handled()
        x = torch.ones(4)
        x.add_(1.0)
        x.add_(1.0)
        assert lane.handled()[0] > before[0]
    assert module.lane_modes() == []


def test_a_mode_pushed_later_sees_every_op_and_the_tracer_still_traces_them(monkeypatch):
    class Recording(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with traced(monkeypatch) as (tr, got, _):
        x = torch.ones(4)
        x.add_(1.0)  # (the plan of add_ is made)
        with Recording() as rec:
            assert module.lane_modes() == [False, False, True, False]
            x.add_(2.0)
            x.mul_(3.0)
        assert module.lane_modes() == [False, False, True]
        tr.buffer.flush()
    assert rec.names == ["aten::add_", "aten::mul_"]
    ops = [ev[2] for ev in got if ev[0] == E.OP]
    assert ops[-2:] == ["aten::add_.Tensor", "aten::mul_.Tensor"]


def test_an_ops_own_error_reaches_the_program_as_without_streamsan(monkeypatch):
    x = torch.ones(3, 4)
    expected = {}
    for name, fn in (("mm", lambda: torch.mm(x, x)), ("index", lambda: x.index_select(0, torch.tensor([7])))):
        with pytest.raises(Exception) as plain:
            fn()
        expected[name] = (type(plain.value), str(plain.value))
    with traced(monkeypatch) as (tr, got, _):
        for _ in range(2):  # (the second time through the lane: the plans are made)
            for name, fn in (("mm", lambda: torch.mm(x, x)),
                             ("index", lambda: x.index_select(0, torch.tensor([7])))):
                with pytest.raises(Exception) as traced_error:
                    fn()
                assert (type(traced_error.value), str(traced_error.value)) == expected[name]
        assert not tr.stopped_on_bug


def test_ops_of_a_thread_started_while_tracing_go_through_the_lane(monkeypatch):
    with traced(monkeypatch) as (tr, got, _):
        x = torch.ones(16)
        x.add_(1.0)  # (the plan is made)
        counts = []

        def work():
            tr._thread_start(None, "call", None)  # (what tracer.start's profile hook does in a new thread)
            before = lane.handled()[0]
            for _ in range(5):
                x.add_(1.0)
            counts.append((module.lane_modes(), lane.handled()[0] - before))

        t = threading.Thread(target=work)
        t.start()
        t.join()
        tr.buffer.flush()
    (modes, handled), = counts
    assert modes == [False, True]  # the thread's own TracingMode, and the lane above it
    assert handled >= 5
    assert sum(1 for ev in got if ev[0] == E.OP and ev[2] == "aten::add_.Tensor") == 6


def test_the_lane_is_off_where_asked_and_the_report_says_which_core_ran(monkeypatch):
    from streamsan.report.environment import tracer_core

    with traced(monkeypatch, "c") as (tr, got, answer):
        assert answer == "STREAMSAN_CORE=c"
        assert module.lane_modes() == [False, False]
        assert tracer_core() == "c (the dispatch lane is off: STREAMSAN_CORE=c)"
    with traced(monkeypatch) as (tr, got, answer):
        assert answer == ""
    monkeypatch.delenv("STREAMSAN_CORE")
    assert tracer_core() == "native"


def test_an_op_with_a_python_kernel_is_traced_as_without_the_lane(monkeypatch):
    """PyTorch runs a Python kernel through the top mode's interpreter: the lane's hands it to CPython's."""
    lib = torch.library.Library("streamsan_lane_test", "DEF")
    lib.define("double_it(Tensor x) -> Tensor")
    lib.impl("double_it", lambda x: x * 2, "CPU")
    seen = {}
    try:
        for core in ("", "c"):
            with traced(monkeypatch, core) as (tr, got, _):
                x = torch.ones(4)
                ys = [torch.ops.streamsan_lane_test.double_it(x) for _ in range(2)]
                tr.buffer.flush()
            assert all(torch.equal(y, torch.full((4,), 2.0)) for y in ys)
            seen[core] = [ev[2] for ev in got if ev[0] == E.OP]
    finally:
        lib._destroy()
    assert seen[""] == seen["c"] == ["aten::ones"] + ["streamsan_lane_test::double_it"] * 2
