"""The CuPy tracer's CPU-testable parts: it and the session import neither torch nor CuPy, a session runs in a
process where torch is not installed, raw-kernel annotations, ranges, event placement around a traced call, and
host accesses through pinned NumPy views (fed to the real analyzer)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from streamsan import events as E
from streamsan.agents import StreamRegistry
from streamsan.analysis.analyzer import Analyzer
from streamsan.sink import EventBuffer
from streamsan.tracers import pinned_numpy
from streamsan.tracers.cupy import active, analyses, annotations
from streamsan.tracers.cupy.tracer import CupyTracer
from streamsan.tracers.pinned_numpy import pinned_class, strided_range
from streamsan.tracers.staging import WRITE_SEEN
from tests.support.paths import ROOT

# A meta-path finder that makes ``import torch`` fail as if torch were not installed.
BLOCK_TORCH = textwrap.dedent("""
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _NoTorch())
    sys.path.insert(0, %r)
""" % str(ROOT))


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT))


def test_cupy_tracer_import_does_not_import_torch_or_cupy():
    r = run_child("""
        import types
        import streamsan.tracers.cupy.tracer as c, streamsan
        assert "torch" not in sys.modules, "torch imported"
        assert "cupy" not in sys.modules, "cupy imported"
        # with a stub cupy module already imported, still no torch
        sys.modules["cupy"] = types.ModuleType("cupy")
        import importlib; importlib.reload(c)
        assert "torch" not in sys.modules
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_session_works_where_torch_is_not_installed(tmp_path):
    r = run_child(f"""
        import json, os, types
        try:
            import torch
            raise SystemExit("torch importable")
        except ModuleNotFoundError:
            pass
        import streamsan
        with streamsan.watch() as s:
            x = sum(range(10))
        assert s.findings == [], s.findings
        rep = s.report()
        assert rep["environment"]["torch"] is None
        # a CuPy-like module imported during a session on a machine without a GPU: noted, nothing patched
        cupy = types.ModuleType("cupy")
        cupy.__version__ = "14.0.0"
        cupy.ndarray = type("ndarray", (), {{}})
        cupy.cuda = types.SimpleNamespace(MemoryHook=object, is_available=lambda: False)
        s2 = streamsan.enable(trace={str(tmp_path / "t.sstrace")!r})
        sys.modules["cupy"] = cupy
        s2._attach_cupy(cupy)
        streamsan.disable()
        assert any("no CUDA device" in p for p in s2.problems), s2.problems
        assert "cupy" not in s2.tracers
        assert os.path.getsize({str(tmp_path / "t.sstrace")!r}) > 0
        assert "torch" not in sys.modules
        print("ok")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout


# ---------------------------------------------------------------------------------------------- annotations
class FakeRawKernel:
    def __init__(self, code, name):
        self.code = code
        self.name = name


CODE = """
extern "C" __global__ void __launch_bounds__(128)
copy_kernel(const float* __restrict__ x, float *y, int n) { }
template <typename T> __global__ void scale(T* out, const T in[], T k = 2) { }
"""


def test_cuda_parameter_names():
    assert annotations.cuda_parameter_names(CODE, "copy_kernel") == ["x", "y", "n"]
    assert annotations.cuda_parameter_names(CODE, "scale<float>") == ["out", "in", "k"]
    assert annotations.cuda_parameter_names(CODE, "missing") is None
    assert annotations.cuda_parameter_names('extern "C" __global__ void f(void) {}', "f") == []


def test_cupy_access_by_name_and_position():
    k = FakeRawKernel(CODE, "copy_kernel")
    assert annotations.cupy_access(k, reads=("x",), writes=(1,)) is k
    ann = annotations.ACCESSES[("raw", CODE, "copy_kernel")]
    assert ann.reads == {0} and ann.writes == {1} and ann.ignore == frozenset()
    annotations.cupy_access(k, reads="x", writes="y", ignore=())
    assert annotations.ACCESSES[("raw", CODE, "copy_kernel")].writes == {1}
    with pytest.raises(ValueError):
        annotations.cupy_access(k, reads=("nope",))
    with pytest.raises(TypeError):
        annotations.cupy_access(object(), reads=(0,))
    with pytest.raises(ValueError):
        annotations.cupy_access(FakeRawKernel("garbage", "k"), reads=("x",))  # names unknown: positions only
    import streamsan

    k2 = FakeRawKernel(CODE, "scale<float>")
    streamsan.cupy_access(k2, writes=("out",), reads=("in",))
    assert annotations.ACCESSES[("raw", CODE, "scale<float>")].reads == {1}


# ---------------------------------------------------------------------------------------------- ranges
def test_strided_range():
    assert strided_range(0, 1000, (4, 8), (32, 4), 4) == (0, 1000, 128)
    assert strided_range(0, 1000, (4, 4), (32, 8), 4) == (0, 1000, 124, (4, (4, 4), (8, 2)))
    # negative strides: the range starts at the lowest address, the layout is mirrored
    assert strided_range(0, 1096, (4, 8), (-32, 4), 4) == (0, 1000, 128)
    assert strided_range(0, 1000, (3, 5), (0, 4), 4) == (0, 1000, 20, (4, (3, 5), (0, 1)))
    assert strided_range(0, 1000, (0, 5), (20, 4), 4) is None
    assert strided_range(0, 1000, (2, 3), (13, 4), 4) == (0, 1000, 25)  # not element-aligned: the extent


def test_registry_forget_gives_a_new_agent():
    buf = EventBuffer([])
    reg = StreamRegistry(buf)
    a = reg.agent(0, 0x1234, E.BLOCKING)
    assert reg.agent(0, 0x1234) == a
    reg.forget(0, 0x1234)
    b = reg.agent(0, 0x1234, 0)
    assert b != a and reg.by_handle[0x1234] == b
    assert reg.agent(0, 0) == reg.agent(0, 1)
    reg.forget(0, 0)  # default streams are never forgotten
    assert reg.agent(0, 0) == reg.agent(0, 1)
    assert len({a, b, reg.agent(0, 0)}) == 3


# ---------------------------------------------------------------------------------------------- a tracer without CuPy
class FakeStream:
    def __init__(self, ptr, device_id=-1):
        self.ptr = ptr
        self.device_id = device_id


def bare_tracer():
    """A CupyTracer wired to a buffer and an analyzer, with the CuPy calls it makes replaced by fakes."""
    np = pytest.importorskip("numpy")
    an = Analyzer()
    buf = EventBuffer([an.feed])
    t = CupyTracer(buf)
    t._numpy = np
    t._ndarray = type("ndarray", (), {})
    t._getDevice = lambda: 0
    t.current = FakeStream(0)
    t._get_current_stream = lambda: t.current
    t._stream_flags = lambda h: 0
    t.running = True
    return t, buf, an


@pytest.fixture
def tracer():
    """A bare tracer made the active one, as ``start()`` does (pinned NumPy views report to it)."""
    t, buf, an = bare_tracer()
    active.tracer = t
    pinned_numpy.attach(t)
    yield t, buf, an
    pinned_numpy.detach(t)
    active.tracer = None


def test_events_inside_a_call_are_placed_around_its_op(tracer):
    t, buf, an = tracer
    side = FakeStream(0xABC, 0)

    def fn():
        t._emit((E.EVENT_RECORD, 7, t._agent(0, 0), 0))  # e.g. a record done inside the call
        t._on_malloc(0, 0x5000, 512)  # the call's output
        t._emit((E.STREAM_SYNC, t._agent(0, 0xABC), 0))  # e.g. a blocking copy's synchronize()
        return "out"

    def analyze(tr, args, kwargs, out, pre):
        return [(0, 0x9000, 64)], [(0, 0x5000, 512)], 0, {0x5000: "float32[128]"}

    assert t._op("cupy.test", fn, (), {}, analyze, lambda a, k: side) == "out"
    kinds = [ev[0] for ev in buf.events if ev[0] not in (E.STREAM, E.DEF_STACK)]
    assert kinds == [E.ALLOC, E.OP, E.EVENT_RECORD, E.STREAM_SYNC]
    alloc = next(ev for ev in buf.events if ev[0] == E.ALLOC)
    op = next(ev for ev in buf.events if ev[0] == E.OP)
    assert alloc[7] == "float32[128]" and alloc[4] == t._agent(0, 0)  # owner: the stream current at malloc
    assert alloc[8] == E.FOREIGN_POOL  # CuPy's pool: torch's record_stream does nothing to it
    assert op[1] == t._agent(0, 0xABC)  # the op runs on the stream it was given
    buf.flush()
    assert an.findings == {}


def test_another_threads_events_meanwhile_keep_their_order(tracer):
    """CuPy releases the GIL inside calls: another thread's events come while a call runs. They keep their order
    and stay out of the call's placement (before, the call moved its allocations and frees before its op and the
    rest after it, reordering the other thread's read of a block after that thread's free and reallocation of it),
    and a call that raises still hands over the events fired inside it."""
    import threading

    t, buf, an = tracer
    side = FakeStream(0xABC, 0)
    other = t._agent(0, 0xDEF)

    def other_thread():
        t._emit((E.OP, other, "cupy.other_read", ((0, 0x7000, 64),), (), 0, 0, 0))
        t._on_malloc(0, 0x7000, 64)  # (not the tracer's block yet: a free of it is not seen)
        t._on_free(0, 0x7000)
        t._on_malloc(0, 0x7000, 64)

    def fn():
        t._on_malloc(0, 0x5000, 512)  # the call's output
        th = threading.Thread(target=other_thread)
        th.start()
        th.join()
        return "out"

    def analyze(tr, args, kwargs, out, pre):
        return [], [(0, 0x5000, 512)], 0, None

    t._op("cupy.test", fn, (), {}, analyze, lambda a, k: side)
    got = [(ev[0], ev[2]) for ev in buf.events if ev[0] in (E.OP, E.ALLOC, E.FREE)]
    assert got == [(E.OP, "cupy.other_read"), (E.ALLOC, 0x7000), (E.FREE, 0x7000), (E.ALLOC, 0x7000),
                   (E.ALLOC, 0x5000), (E.OP, "cupy.test")]

    def failing():
        t._on_malloc(0, 0x9000, 16)
        raise RuntimeError("the call's own error")

    with pytest.raises(RuntimeError):
        t._op("cupy.fails", failing, (), {}, analyze, lambda a, k: side)
    assert (E.ALLOC, 0x9000) == [(ev[0], ev[2]) for ev in buf.events if ev[0] == E.ALLOC][-1]
    assert getattr(t._tl, "inner", None) is None


def test_nested_calls_are_not_ops_but_their_syncs_stay(tracer):
    t, buf, an = tracer

    def inner():
        t._emit((E.STREAM_SYNC, t._agent(0, 0), 0))
        return 1

    def outer():
        return t._op("cupy.inner", inner, (), {}, lambda *a: ([], [(0, 1, 8)], 0, None))

    t._op("cupy.outer", outer, (), {}, lambda *a: ([(0, 1, 8)], [], 0, None))
    ops = [ev[2] for ev in buf.events if ev[0] == E.OP]
    assert ops == ["cupy.outer"]
    assert [ev[0] for ev in buf.events if ev[0] in (E.OP, E.STREAM_SYNC)] == [E.OP, E.STREAM_SYNC]


# ---------------------------------------------------------------------------------------------- pinned NumPy views
def pinned(t, n=64):
    np = pytest.importorskip("numpy")
    host = np.zeros(n, dtype=np.float32)
    ptr = host.__array_interface__["data"][0]
    t._on_pinned(ptr, host.nbytes)
    return host, host.view(pinned_class()), ptr


def d2h(t, agent, ptr, nbytes):
    """An async device-to-host copy into pinned memory, as ndarray.get(out=p, blocking=False) records it."""
    t._emit((E.OP, agent, "cupy.ndarray.get", ((0, 0x7000, nbytes),), ((E.PINNED, ptr, nbytes),), 0, 0, 0))


def test_host_read_of_pinned_view_races_with_async_d2h(tracer):
    t, buf, an = tracer
    host, p, ptr = pinned(t)
    default = t._agent(0, 0)
    d2h(t, default, ptr, host.nbytes)
    total = p.sum()  # NumPy's add.reduce through __array_ufunc__
    assert float(total) == 0.0 and type(total).__module__ == "numpy"
    buf.flush()
    fs = an.sorted_findings()
    assert [(f.kind, f.previous.name, f.current.name) for f in fs] == [
        ("host-device", "cupy.ndarray.get", "numpy.add.reduce")]


def test_host_accesses_after_event_sync_are_clean(tracer):
    t, buf, an = tracer
    np = pytest.importorskip("numpy")
    host, p, ptr = pinned(t)
    default = t._agent(0, 0)
    d2h(t, default, ptr, host.nbytes)
    t._emit((E.EVENT_RECORD, 99, default, 0))
    t._emit((E.EVENT_SYNC, 99, 0))
    p.sum()
    p[3] = 2.0
    p[1:5] += 1
    np.copyto(p, 1.0)
    p.fill(3.0)
    assert float(p[0]) == 3.0 and isinstance(p[2:4], pinned_class())
    assert type(p + 1) is np.ndarray and type(p.copy()) is np.ndarray
    buf.flush()
    assert an.sorted_findings() == []
    names = [ev[2] for ev in buf.events] or []
    assert names == []  # flushed


def test_host_write_of_one_element_vs_copy_of_another_part(tracer):
    t, buf, an = tracer
    host, p, ptr = pinned(t, 64)
    side = t._agent(0, 0xAB0)
    # an H2D copy on a side stream reads the first half of p; the host then writes element 40 and element 3
    t._emit((E.OP, side, "cupy.ndarray.set", ((E.PINNED, ptr, 128),), ((0, 0x8000, 128),), 0, 0, 0))
    p[40] = 1.0
    buf.flush()
    assert an.sorted_findings() == []
    p[3] = 1.0
    buf.flush()
    fs = an.sorted_findings()
    assert [(f.kind, f.previous.name, f.current.name) for f in fs] == [
        ("host-device", "cupy.ndarray.set", "numpy.ndarray.__setitem__")]


def test_pinned_view_pickles_as_plain_ndarray(tracer):
    import pickle

    np = pytest.importorskip("numpy")
    t, buf, an = tracer
    host, p, ptr = pinned(t, 4)
    q = pickle.loads(pickle.dumps(p))
    assert type(q) is np.ndarray and q.shape == (4,)


class FakeDeviceArray:
    """What ``device_range`` reads of a cupy.ndarray."""

    def __init__(self, ptr, nbytes):
        self.size = nbytes // 4
        self.nbytes = nbytes
        self.data = type("MemoryPointer", (), {"ptr": ptr, "device_id": 0})()
        self._c_contiguous = True


def h2d_set(t, host, side):
    """``dev.set(host, stream=side)``: an asynchronous copy out of pinned memory."""
    t._op("cupy.ndarray.set", lambda *a: None, (FakeDeviceArray(0x8000, host.nbytes), host), {}, analyses.set_h2d,
          lambda a, k: side)


def test_untraced_refill_of_a_pinned_array_races_with_the_previous_set(tracer):
    """A plain NumPy array over pinned memory (no PinnedArray: its writes are not traced) refilled before the
    stream's previous copy out of it is done: found by the bytes that changed, at the next copy."""
    t, buf, an = tracer
    host, p, ptr = pinned(t, 64)
    side = FakeStream(0xAB0, 0)
    h2d_set(t, host, side)
    host[3] = 5.0  # untraced
    h2d_set(t, host, side)
    buf.flush()
    fs = an.sorted_findings()
    assert [(f.kind, f.previous.name, f.current.name, f.lo - ptr, f.hi - ptr) for f in fs] == [
        ("host-device", "cupy.ndarray.set", WRITE_SEEN, 12, 16)]


def test_traced_refill_is_reported_once_and_synchronized_refills_are_clean(tracer):
    t, buf, an = tracer
    host, p, ptr = pinned(t, 64)
    side = FakeStream(0xAB0, 0)
    h2d_set(t, host, side)
    p[3] = 5.0  # traced (PinnedArray): reported as itself, and forgets the kept bytes
    h2d_set(t, host, side)
    t._emit((E.STREAM_SYNC, t._agent(0, 0xAB0), 0))
    host[3] = 6.0  # untraced, after the host synchronized with the stream
    h2d_set(t, host, side)
    buf.flush()
    assert [(f.kind, f.previous.name, f.current.name) for f in an.sorted_findings()] == [
        ("host-device", "cupy.ndarray.set", "numpy.ndarray.__setitem__")]


def test_calls_on_a_capturing_stream_are_not_run_now(tracer):
    """During ``Stream.begin_capture`` a call on that stream is a node of the graph: no op, while its allocation
    (a host-side action) stays; calls on other streams run as usual."""
    t, buf, an = tracer
    side = FakeStream(0xCA0, 0)
    t.captures.begin(t._agent(0, 0xCA0), 0)

    def fn():
        t._on_malloc(0, 0x6000, 256)
        return "out"

    def analyze(tr, args, kwargs, out, pre):
        return [(0, 0x9000, 64)], [(0, 0x6000, 256)], 0, None

    t._op("cupy.captured", fn, (), {}, analyze, lambda a, k: side)
    t._op("cupy.elsewhere", fn, (), {}, analyze, lambda a, k: FakeStream(0xDD0, 0))
    assert [(ev[0], ev[2] if ev[0] == E.OP else None) for ev in buf.events if ev[0] in (E.OP, E.ALLOC)] == [
        (E.ALLOC, None), (E.ALLOC, None), (E.OP, "cupy.elsewhere")]
    cap = t.captures.of[t._agent(0, 0xCA0)]
    assert [n[2] for n in cap.nodes] == ["cupy.captured"] and cap.writes == [(0, 0x6000, 256)]
