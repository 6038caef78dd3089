"""CUDA graph capture on CuPy streams, on a stand-in of CuPy's stream classes (tests/test_cupy_tracer.py's bare
tracer with the stream, event and graph patches installed): streams that join a capture through an event, calls
captured as graph nodes, failed and invalidated captures that run nothing, and ``Graph.launch`` as one op on the
launching stream, fed to the real analyzer."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests.tracers.cupy.test_cupy_tracer import bare_tracer, pinned  # noqa: E402

from streamsan import events as E  # noqa: E402
from streamsan.tracers import pinned_numpy  # noqa: E402
from streamsan.tracers.cupy import active  # noqa: E402
from streamsan.tracers.cupy.patches import events, graphs, streams  # noqa: E402


class CaptureError(RuntimeError):
    """What CuPy raises for a capture CUDA refuses (``CUDARuntimeError``)."""


class FakeGraph:
    """``cupy.cuda.Graph``: launched on a stream, or the current one."""

    def __init__(self):
        self.launched = []

    def launch(self, stream=None):
        self.launched.append(stream)

    def upload(self, stream=None):
        pass


def fake_cupy():
    """The parts of ``cupy.cuda.stream`` the stream, event and graph patches replace. A stream's ``end_capture``
    raises, as CUDA does, when ``fail`` is set (an invalidated capture, or a stream that only joined one)."""
    count = [0xE00]

    class Event:
        def __init__(self):
            count[0] += 1
            self.ptr = count[0]

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        @property
        def done(self):
            return True

    class _BaseStream:
        def synchronize(self):
            pass

        def record(self, event=None):
            return event if event is not None else Event()

        def wait_event(self, event):
            pass

        @property
        def done(self):
            return True

        def begin_capture(self, mode=None):
            pass

        def end_capture(self):
            if self.fail:
                raise CaptureError("cudaErrorStreamCaptureInvalidated")
            return FakeGraph()

    class Stream(_BaseStream):
        def __init__(self, ptr, device_id=0):
            self.ptr = ptr
            self.device_id = device_id
            self.fail = False

    stream = types.SimpleNamespace(_BaseStream=_BaseStream, Stream=Stream, Event=Event)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(stream=stream))


@pytest.fixture
def cp():
    """(the stand-in CuPy, its tracer, the analyzer), the patches installed."""
    t, buf, an = bare_tracer()
    t.cp = fake_cupy()
    active.tracer = t
    pinned_numpy.attach(t)
    undo = [p.install(t) for p in (streams, events, graphs)]
    yield t.cp, t, an
    for u in reversed(undo):
        u()
    pinned_numpy.detach(t)
    active.tracer = None


def call(t, stream, name, reads=(), writes=()):
    """A traced CuPy call on ``stream`` that reads and writes these device ranges."""
    t.current = stream
    t._op(name, lambda: None, (), {}, lambda tr, a, k, o, pre: (list(reads), list(writes), 0, None))


def findings(t, an):
    t.buffer.flush()
    return [(f.kind, an.agents[f.previous.agent].name, f.previous.name, an.agents[f.current.agent].name,
             f.current.name) for f in an.sorted_findings()]


A, OUT1, OUT2 = (0, 0x10000, 400), (0, 0x20000, 400), (0, 0x30000, 400)


def fork_join(cp, t, join_before_read=True):
    """CuPy's own fork-join capture (tests/cupy_tests/cuda_tests/test_graph.py): ``out1 = a * 100`` on s1, s2
    waits on an event recorded after it and computes ``out2`` from ``out1``, s1 waits for s2 and reads ``out2``
    (before or after that wait)."""
    s1 = cp.cuda.stream.Stream(0xA10)
    s2 = cp.cuda.stream.Stream(0xA20)
    e1, e2 = cp.cuda.stream.Event(), cp.cuda.stream.Event()
    s1.begin_capture()
    call(t, s1, "cupy.multiply", reads=[A], writes=[OUT1])
    e1.record(s1)
    s2.wait_event(e1)  # s2 joins the capture
    call(t, s2, "cupy.add", reads=[OUT1], writes=[OUT2])
    e2.record(s2)
    if not join_before_read:
        call(t, s1, "cupy.sum", reads=[OUT2], writes=[(0, 0x40000, 4)])
    s1.wait_event(e2)
    if join_before_read:
        call(t, s1, "cupy.sum", reads=[OUT2], writes=[(0, 0x40000, 4)])
    g = s1.end_capture()
    return s1, s2, g


def test_a_correct_fork_join_capture_is_clean_and_its_launch_is_one_op(cp):
    cp_, t, an = cp
    s1, s2, g = fork_join(cp_, t)
    null = cp_.cuda.stream.Stream(0)
    t.current = null
    g.launch()  # on the current stream: the null stream
    call(t, null, "cupy.ndarray.get", reads=[OUT2])  # the null stream, after the launch in its order
    evs = list(t.buffer.events)
    a0, a1, a2 = t._agent(0, 0), t._agent(0, 0xA10), t._agent(0, 0xA20)
    ops = [(ev[1], ev[2]) for ev in evs if ev[0] == E.OP]
    assert ops == [(a0, "cupy.cuda.Graph.launch"), (a0, "cupy.ndarray.get")]
    (graph,) = [ev for ev in evs if ev[0] == E.GRAPH]
    assert [(n[0], n[1] if n[0] == E.OP else n[2]) for n in graph[1]] == [
        (E.OP, a1), (E.EVENT_RECORD, a1), (E.EVENT_WAIT, a2), (E.OP, a2), (E.EVENT_RECORD, a2),
        (E.EVENT_WAIT, a1), (E.OP, a1)]
    assert not [ev for ev in evs if ev[0] in (E.EVENT_RECORD, E.EVENT_WAIT)]  # (nodes of the graph only)
    launch = next(ev for ev in evs if ev[0] == E.OP)
    assert launch[3] == (A, OUT1, OUT2) and launch[4] == (OUT1, OUT2, (0, 0x40000, 4))
    assert findings(t, an) == []
    assert isinstance(g, FakeGraph) and type(g) is graphs.TracedGraph and g.launched == [None]
    assert not t.captures.of  # both streams left the capture


def test_a_read_before_the_join_races_inside_the_graph(cp):
    cp_, t, an = cp
    s1, s2, g = fork_join(cp_, t, join_before_read=False)
    assert findings(t, an) == [("device-device", "s2", "cupy.add", "s1", "cupy.sum")]


def test_a_launch_races_with_the_host_without_a_synchronization(cp):
    """A captured copy into pinned memory runs at each launch: the host reading the pinned view after the launch
    races with it unless the host synchronizes with the launching stream."""
    cp_, t, an = cp
    host, p, ptr = pinned(t)
    s = cp_.cuda.stream.Stream(0xB10)
    s.begin_capture()
    call(t, s, "cupy.ndarray.get", reads=[A], writes=[(E.PINNED, ptr, host.nbytes)])
    g = s.end_capture()
    assert findings(t, an) == []  # the capture ran nothing
    p.sum()  # the host reads before any launch: clean
    assert findings(t, an) == []
    g.launch(s)
    p.sum()
    assert findings(t, an) == [("host-device", "s", "cupy.cuda.Graph.launch", "host", "numpy.add.reduce")]
    g.launch(s)
    s.synchronize()
    p[0] = 1.0
    assert findings(t, an) == [("host-device", "s", "cupy.cuda.Graph.launch", "host", "numpy.add.reduce")]


def test_a_failed_capture_runs_nothing(cp):
    """CuPy's capture failure tests: s2 joins a capture and writes there, its own ``end_capture`` fails (it is not
    the origin) and invalidates the capture, whose origin's ``end_capture`` then fails too; then the null stream
    writes the same memory. Nothing of the capture ran: no race (taken for work, s2's write raced)."""
    cp_, t, an = cp
    s1 = cp_.cuda.stream.Stream(0xC10)
    s2 = cp_.cuda.stream.Stream(0xC20)
    null = cp_.cuda.stream.Stream(0)
    e = cp_.cuda.stream.Event()
    s1.begin_capture()
    e.record(s1)
    s2.wait_event(e)
    call(t, s2, "cupy.power", reads=[A], writes=[OUT1])
    s2.fail = s1.fail = True
    with pytest.raises(CaptureError):
        s2.end_capture()
    assert t.captures.of  # still capturing, invalidated
    with pytest.raises(CaptureError):
        s1.end_capture()
    assert not t.captures.of
    call(t, null, "cupy.fill", writes=[OUT1])
    call(t, s2, "cupy.fill", writes=[OUT2])  # s2 runs its work again
    call(t, null, "cupy.sum", reads=[OUT2])
    assert findings(t, an) == [("device-device", "s2", "cupy.fill", "default", "cupy.sum")]
    assert not [ev for ev in t.buffer.events if ev[0] == E.GRAPH]


def test_a_capture_whose_end_succeeds_despite_an_invalidating_member_runs_nothing(cp):
    """An invalidated capture gives no graph even where the origin's end_capture returns one."""
    cp_, t, an = cp
    s1 = cp_.cuda.stream.Stream(0xD10)
    s2 = cp_.cuda.stream.Stream(0xD20)
    e = cp_.cuda.stream.Event()
    s1.begin_capture()
    e.record(s1)
    s2.wait_event(e)
    s2.fail = True
    with pytest.raises(CaptureError):
        s2.end_capture()
    g = s1.end_capture()
    assert type(g) is FakeGraph  # the graph itself, not wrapped: its launches run nothing the tracer knows of
    g.launch(s1)
    assert not [ev for ev in t.buffer.events if ev[0] == E.OP]
