"""The C tracer (``streamsan/_ctracer.c``) against the Python tracer: the same program gives the same events.

Both run on the CPU stand-in of ``tests/support/standin.py`` (the torch tracer with CPU tensors playing CUDA's part,
each fresh output announced as an allocation and freed 8 ops later). Pointers differ between two runs of a program, so
they are renamed in order of first appearance; everything else (op names, agents, ranges, stacks, allocation
sizes and descriptions, event order) must be equal.
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch")

try:
    from streamsan import _ctracer
except ImportError:  # built without a C compiler
    _ctracer = None

needs_c_tracer = pytest.mark.skipif(_ctracer is None or not _ctracer.AVAILABLE, reason="the C tracer is not built")

from streamsan import events as E  # noqa: E402


def test_the_c_tracer_is_built_where_it_can_be():
    """The extension is optional at install (a compile error only warns): where a C compiler and Python 3.11+ are,
    it must be there, or every test of it would be skipped without a word."""
    import shutil
    import sysconfig

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if sys.version_info < (3, 11) or not shutil.which(cc) or not os.path.exists(
            os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no C compiler or Python headers here, or Python before 3.11")
    assert _ctracer is not None, "streamsan._ctracer is not built: see pip's build output"
    assert _ctracer.AVAILABLE


def program():
    """A mix of what the C tracer handles itself (contiguous and strided inputs, lists, out= and in-place writes,
    ops with no access, allocating ops, several outputs, copies) and what it leaves to Python (factories)."""
    torch.manual_seed(0)
    keep = []
    x = torch.randn(16, 32)
    w = torch.randn(24, 32)
    b = torch.randn(24)
    keep += [x, w, b]
    y = torch.nn.functional.linear(x, w, b)
    y.add_(1.0)
    t = y.t()  # a view: no access
    z = t.contiguous()  # a strided read
    y2 = y * 2
    cat = torch.cat([y, y2], dim=0)
    st = torch.stack([x, x])
    parts = torch.split(cat, 8)
    vals, idx = torch.topk(y, 3, dim=1)
    ln = torch.nn.functional.layer_norm(x, (32,))
    e = torch.empty(10)
    zl = torch.zeros_like(x)
    out = torch.empty(16, 32)
    torch.mul(x, 3.0, out=out)
    sm = torch.softmax(y, dim=-1)
    s = sm.sum(dim=0)
    c = x.clone()
    c.copy_(x)  # a copy between device tensors
    ws = [torch.ones(4), torch.ones(4)]
    torch._foreach_add_(ws, 1.0)
    rows = torch.tensor([0, 2, 4])
    sel = x.index_select(0, rows)
    # strided inputs of every shape of range: dense but permuted, with gaps, broadcast (stride 0), a column block
    dense_t = t + 1
    gaps = x[:, ::2] * 2
    bcast = x[:1].expand(16, 32) + 1
    block = x[:, 4:8].sum()
    c[:, ::3].add_(1.0)  # an in-place write through a strided view
    keep += [y, t, z, y2, cat, st, parts, vals, idx, ln, e, zl, out, sm, s, c, ws, rows, sel, dense_t, gaps, bcast,
             block]
    with pytest.raises(RuntimeError):
        torch.mm(x, x)  # the op's own error reaches the program in both
    return keep


def canonical(events):
    """Events with pointers renamed by first appearance."""
    names: dict = {}

    def ptr(p):
        return names.setdefault(p, len(names))

    def rng(r):
        return (r[0], ptr(r[1])) + tuple(r[2:])

    out = []
    for ev in events:
        kind = ev[0]
        if kind in (E.ALLOC, E.FREE):
            ev = ev[:2] + (ptr(ev[2]),) + ev[3:]
        elif kind == E.OP:
            ev = ev[:3] + (tuple(rng(r) for r in ev[3]), tuple(rng(r) for r in ev[4])) + ev[5:]
        out.append(ev)
    return out


@pytest.fixture
def standin():
    """The CPU stand-in, on for the test (it installs PyTorch's GPU trace callbacks)."""
    from tests.support.standin import StandIn

    with StandIn() as s:
        yield s


def run(core):
    from streamsan.tracers.torch.callbacks import GpuTrace
    from streamsan.tracers.torch.dispatch import TracingMode
    from tests.support.standin import StandIn

    declined = []
    python_dispatch = TracingMode.__torch_dispatch__.__code__

    def count_declined(frame, event, arg):  # (a profile hook: no frame of its own on the stacks captured)
        if event == "call" and frame.f_code is python_dispatch:
            declined.append(frame.f_locals.get("func"))

    got = []
    kept = []  # (every op's output stays alive: no address is reused, so pointers can be renamed)
    with StandIn(consumer=got.extend, keep=kept) as standin:
        mode = standin.enter("trace" if core == "c" else "trace-python")
        sys.setprofile(count_declined)
        try:
            for _ in range(3):  # (the first time, each op's plan is made in Python)
                kept.append(program())
        finally:
            sys.setprofile(None)
            mode.__exit__(None, None, None)
            mode.tracer.buffer.flush()
            GpuTrace.active = None
    return canonical(got), declined, mode


@needs_c_tracer
def test_same_events_as_the_python_tracer():
    (c_events, c_declined, _), (py_events, py_declined, _) = [
        run(core) for core in ("c", "python")]  # (one call site: the same stacks)
    assert len(c_events) > 150
    assert c_events == py_events
    # the C tracer did the work: it left to Python only the ops it does not handle and the first call of each op
    assert len(c_declined) < len(py_declined) / 2
    # factories (no tensor to read a device from) stay Python's, every time (the stand-in wraps each op)
    assert sum("randn" in str(getattr(d, "func", d)) for d in c_declined) == 3 * 3


@needs_c_tracer
def test_internal_error_stops_tracing_and_the_program_goes_on(standin):
    """A bug of streamsan's surfacing in the C path: tracing stops with a note, and the op's result is the
    program's as without streamsan."""
    mode = standin.enter("trace")
    x = torch.ones(4)
    x + 1  # the plan of add.Tensor is made (Python path)
    mode.tracer.stacks.define = None  # breaks the C tracer's stack capture for a new call site
    y = x + 2  # a new call site
    mode.__exit__(None, None, None)
    assert torch.equal(y, torch.full((4,), 3.0))
    assert mode.tracer.stopped_on_bug


@needs_c_tracer
def test_allocation_callbacks_match_the_python_ones(standin):
    """PyTorch's allocation and free callbacks in C against the Python ones, on the same tracer states: inside an
    op of this thread, outside one, inside a memory pool, a free of a block seen and of one not seen."""
    import threading

    from streamsan.agents import StreamRegistry
    from streamsan.sink import EventBuffer
    from streamsan.stacks import StackTable

    from streamsan import _ctracer as c
    from streamsan.tracers.torch import ccore
    from streamsan.tracers.torch.callbacks import GpuTrace as gt
    from streamsan.tracers.torch.tracer import TorchTracer

    py_alloc, py_free = gt.python_callbacks[:2]

    def state():
        buf = EventBuffer([], batch=2)  # (small: the free path's flush rule is reached)
        tr = TorchTracer(buf, StreamRegistry(buf), StackTable())
        tr.running = tr.tracing = True
        return tr

    def drive(alloc, free):
        tr = state()
        gt.active = tr
        own, others = [], []  # the events fired inside an op of this thread, of another thread
        try:
            tr.op_agent = (0, 3, 7, 0, threading.get_ident(), own)
            alloc(1000)
            tr.pool_of_thread[threading.get_ident()] = 5
            alloc(2000)  # in a pool: the Python path's
            tr.pool_of_thread.clear()
            free(2000)  # a free inside the op: the op's too
            tr.op_agent = (0, 3, 7, 0, threading.get_ident() + 1, others)  # another thread's op
            alloc(3000)
            mine_too = []  # this thread's op under way too, begun before the other thread's
            tr.buffer.ops_of_threads[threading.get_ident()] = (0, 4, 8, 0, threading.get_ident(), mine_too)
            alloc(3500)
            free(3500)
            del tr.buffer.ops_of_threads[threading.get_ident()]
            tr.op_agent = None
            alloc(4000)
            for p in (1000, 2000, 9999, 3000, 4000):
                free(p)
            tr.engine_grads.add(1000)
            alloc(1000)
            free(1000)
            tr.in_scope = 0  # hooks scope, outside a hooked region: nothing
            alloc(6000)
            tr.op_agent = (0, 3, 7, 0, threading.get_ident(), own)
            alloc(7000)  # inside an op (of a hooked region)
            return (list(tr.buffer.events), list(own), list(others), dict(tr.live_device), set(tr.engine_grads),
                    tr.buffer.total, list(mine_too))
        finally:
            gt.active = None

    expected = drive(py_alloc, py_free)
    got = drive(c.Callback(gt, py_alloc, ccore.CALLBACK_ALLOC), c.Callback(gt, py_free, ccore.CALLBACK_FREE))
    assert got == expected
    assert expected[5] > 0  # (frees outside an op filled the buffer: flushed)
    assert [(ev[0], ev[2]) for ev in expected[1]] == [(E.ALLOC, 1000), (E.ALLOC, 2000), (E.FREE, 2000),
                                                      (E.ALLOC, 7000)]
    assert expected[2] == []  # another thread's op: this thread's events are not its
    assert [(ev[0], ev[2]) for ev in expected[6]] == [(E.ALLOC, 3500), (E.FREE, 3500)]  # but its own op's
    assert 6000 not in expected[3] and 7000 in expected[3]


@needs_c_tracer
def test_event_callbacks_match_the_python_ones(standin):
    """PyTorch's event record and wait callbacks in C against the Python ones: inside an op of this thread (the op's
    stack), outside one (a stack captured there: the same frames, ids and definitions), inside another thread's."""
    import threading

    from streamsan.agents import StreamRegistry
    from streamsan.sink import EventBuffer
    from streamsan.stacks import StackTable

    from streamsan import _ctracer as c
    from streamsan.tracers.torch import ccore
    from streamsan.tracers.torch.callbacks import GpuTrace as gt
    from streamsan.tracers.torch.tracer import TorchTracer

    py_record, py_wait = gt.python_callbacks[2:]

    def drive(record, wait):
        buf = EventBuffer([], batch=2)  # (small: the flush rule is reached)
        tr = TorchTracer(buf, StreamRegistry(buf), StackTable())
        tr.running = tr.tracing = True
        got = []
        buf.consumers.append(got.extend)
        gt.active = tr
        own = []
        try:
            tr.op_agent = (0, 3, 7, 0, threading.get_ident(), own)
            record(11, 1001)
            tr.op_agent = None
            for _ in range(2):  # (the second time, the stack is known)
                record(12, 1001)
                wait(12, 1002)
            tr.op_agent = (0, 3, 7, 0, threading.get_ident() + 1, [])
            wait(11, 1002)
            tr.op_agent = None
            buf.flush()
            return got, own
        finally:
            gt.active = None

    left_to_python = []

    def counted(callback):
        def fallback(*args):
            left_to_python.append(args)
            return callback(*args)
        return fallback

    expected, got = [drive(*pair) for pair in (  # (one call site: the same stacks)
        (py_record, py_wait),
        (c.Callback(gt, counted(py_record), ccore.CALLBACK_EVENT, E.EVENT_RECORD),
         c.Callback(gt, counted(py_wait), ccore.CALLBACK_EVENT, E.EVENT_WAIT)))]
    assert got == expected
    assert left_to_python == []  # (the C code did it all)
    events, own = expected
    kinds = [ev[0] for ev in events]
    assert kinds.count(E.EVENT_RECORD) == 2 and kinds.count(E.EVENT_WAIT) == 3 and E.DEF_STACK in kinds
    assert own == [(E.EVENT_RECORD, 11, 1, 7)]  # inside an op: the op's own list, with its stack
