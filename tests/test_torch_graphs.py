"""CUDA graph captures and replays in the torch tracer, on the CPU: the capture's bookkeeping is driven by hand
(what the patched ``capture_begin`` / ``capture_end`` do), and a replay runs on a stand-in current stream. The
GPU half is tests/gpu/test_cuda_graphs.py."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.analyzer import Analyzer  # noqa: E402
from streamsan.findings import DEVICE_DEVICE  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers import torch as T  # noqa: E402

REPLAY_STREAM = 0x5000
OTHER = 7


class Graph:
    """Stands for a torch.cuda.CUDAGraph (the tracer keeps a weak reference to it)."""


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setattr(T, "_cuda_raw_stream", lambda dev: REPLAY_STREAM)
    analyzer = Analyzer()
    tracer = T.TorchTracer(EventBuffer([analyzer.feed]))
    tracer.start()
    try:
        yield tracer, analyzer
    finally:
        tracer.stop()


def test_a_capture_keeps_its_accesses_for_the_replay(traced):
    tracer, analyzer = traced
    g = Graph()
    tracer.graphs.current = ([(0, 0x1000, 64), (0, 0x1020, 64)], [(0, 0x2000, 64), (E.PINNED, 0x9000, 8)], True)
    tracer.tracing = False
    tracer._end_capture(g)
    assert tracer.tracing is True and tracer.graphs.current is None
    assert tracer.graphs.accesses.get(g) == (0, ((0, 0x1000, 96),), ((E.PINNED, 0x9000, 8), (0, 0x2000, 64)))


def test_a_replay_is_one_op_on_the_current_stream(traced):
    tracer, analyzer = traced
    g = Graph()
    tracer.graphs.current = ([(0, 0x1000, 64)], [(0, 0x2000, 64)], True)
    tracer._end_capture(g)
    other = tracer.agent(0, OTHER)
    tracer.buffer.events.append(E.op(other, "aten::fill_.Scalar", writes=[(0, 0x1000, 64)]))
    tracer._replay(g)
    tracer.stop()
    analyzer.finish()
    replay = tracer.agent(0, REPLAY_STREAM)
    assert [(f.kind, f.previous.agent, f.previous.name, f.current.agent, f.current.name)
            for f in analyzer.sorted_findings()] == [
        (DEVICE_DEVICE, other, "aten::fill_.Scalar", replay, "CUDAGraph.replay")]


def test_a_graph_captured_untraced_is_replayed_with_a_note(traced):
    tracer, analyzer = traced
    tracer._replay(Graph())
    tracer.stop()
    analyzer.finish()
    assert [text for _, text in analyzer.notes] == [T.GRAPH_UNTRACKED]


def test_tracing_stopped_by_a_bug_during_capture_stays_stopped(traced):
    tracer, analyzer = traced
    tracer.graphs.current = ([], [], True)
    tracer.tracing = False
    tracer._stop_on_bug(RuntimeError("boom"), "somewhere")
    tracer._end_capture(Graph())
    assert tracer.tracing is False


def test_host_ops_on_pinned_memory_run_now_during_a_capture(traced):
    """A CPU op during capture is not a node of the graph: on pinned memory it is a host access at once."""
    tracer, analyzer = traced
    host = torch.zeros(16)
    st = host.untyped_storage()
    tracer.buffer.events.append(E.alloc(E.PINNED, st.data_ptr(), st.nbytes(), E.HOST))
    tracer.pinned[st.data_ptr()] = st.nbytes()
    tracer.graphs.current = ([], [], True)
    tracer.tracing = False
    host.add_(1)
    torch.ones(4).mul_(2)  # pageable: nothing
    cap = tracer.graphs.current
    tracer._end_capture(None)
    assert cap[:2] == ([], [])
    ops = [(ev[1], ev[2], ev[4]) for ev in tracer.buffer.events if ev[0] == E.OP]
    assert ops == [(E.HOST, "aten::add_.Tensor", ((E.PINNED, st.data_ptr(), 64),))]
