"""CUDA graph captures and replays in the torch tracer, on the CPU: the capture's bookkeeping is driven by hand
(what the patched ``capture_begin`` / ``capture_end`` do), and a replay runs on a stand-in current stream. The
GPU half is tests/gpu/graphs/test_cuda_graphs.py."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.analysis.findings import DEVICE_DEVICE  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch import device  # noqa: E402
from streamsan.tracers.torch.callbacks import on_event_record, on_event_wait  # noqa: E402
from streamsan.tracers.torch import cuda_graphs  # noqa: E402
from streamsan.tracers.torch.cuda_graphs import GRAPH_CONTEXT, GRAPH_UNTRACKED, captured, end_capture  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402

REPLAY_STREAM = 0x5000
OTHER = 7


class Graph:
    """Stands for a torch.cuda.CUDAGraph (the tracer keeps a weak reference to it)."""


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setattr(device, "raw_stream", lambda dev: REPLAY_STREAM)
    analyzer = Analyzer()
    tracer = TorchTracer(EventBuffer([analyzer.feed]))
    tracer.start()
    try:
        yield tracer, analyzer
    finally:
        tracer.stop()


def test_a_capture_keeps_its_accesses_for_the_replay(traced):
    tracer, analyzer = traced
    g = Graph()
    tracer.graphs.current = ([(0, 0x1000, 64), (0, 0x1020, 64)], [(0, 0x2000, 64), (E.PINNED, 0x9000, 8)], True, [])
    tracer.tracing = False
    end_capture(tracer, g)
    assert tracer.tracing is True and tracer.graphs.current is None
    assert tracer.graphs.accesses.get(g) == (0, ((0, 0x1000, 96),), ((E.PINNED, 0x9000, 8), (0, 0x2000, 64)))


def test_a_replay_is_one_op_on_the_current_stream(traced):
    tracer, analyzer = traced
    g = Graph()
    tracer.graphs.current = ([(0, 0x1000, 64)], [(0, 0x2000, 64)], True, [])
    end_capture(tracer, g)
    other = tracer.agent(0, OTHER)
    tracer.buffer.events.append(E.op(other, "aten::fill_.Scalar", writes=[(0, 0x1000, 64)]))
    cuda_graphs.replay(tracer, g)
    tracer.stop()
    analyzer.finish()
    replay = tracer.agent(0, REPLAY_STREAM)
    assert [(f.kind, f.previous.agent, f.previous.name, f.current.agent, f.current.name)
            for f in analyzer.sorted_findings()] == [
        (DEVICE_DEVICE, other, "aten::fill_.Scalar", replay, "CUDAGraph.replay")]


def test_a_graph_captured_untraced_is_replayed_with_a_note(traced):
    tracer, analyzer = traced
    cuda_graphs.replay(tracer, Graph())
    tracer.stop()
    analyzer.finish()
    assert [text for _, text in analyzer.notes] == [GRAPH_UNTRACKED]


def test_tracing_stopped_by_a_bug_during_capture_stays_stopped(traced):
    tracer, analyzer = traced
    tracer.graphs.current = ([], [], True, [])
    tracer.tracing = False
    tracer.stop_on_bug(RuntimeError("boom"), "somewhere")
    end_capture(tracer, Graph())
    assert tracer.tracing is False


def test_host_ops_on_pinned_memory_run_now_during_a_capture(traced):
    """A CPU op during capture is not a node of the graph: on pinned memory it is a host access at once."""
    tracer, analyzer = traced
    host = torch.zeros(16)
    st = host.untyped_storage()
    tracer.buffer.events.append(E.alloc(E.PINNED, st.data_ptr(), st.nbytes(), E.HOST))
    tracer.pinned[st.data_ptr()] = st.nbytes()
    tracer.graphs.current = ([], [], True, [])
    tracer.tracing = False
    host.add_(1)
    torch.ones(4).mul_(2)  # pageable: nothing
    cap = tracer.graphs.current
    end_capture(tracer, None)
    assert cap[:2] == ([], [])
    ops = [(ev[1], ev[2], ev[4]) for ev in tracer.buffer.events if ev[0] == E.OP]
    assert ops == [(E.HOST, "aten::add_.Tensor", ((E.PINNED, st.data_ptr(), 64),))]


SIDE = 0x6000


def _fork_join_capture(tracer, monkeypatch, fork_after_producer):
    """A capture that forks a side stream from the capture stream (an event recorded there, waited for on the
    side), runs a consumer on the side and joins back: as the callbacks and the captured ops report it. The
    producer writes 0x2000 on the capture stream; the consumer reads it on the side stream."""
    current = {"stream": REPLAY_STREAM}
    monkeypatch.setattr(device, "raw_stream", lambda dev: current["stream"])
    tracer.graphs.current = ([], [], True, [])
    tracer.tracing = False
    cap = tracer.graphs.current
    capture, side = tracer.agent(0, REPLAY_STREAM), tracer.agent(0, SIDE)
    monkeypatch.setattr(tracer, "agent_for_handle", lambda s: {REPLAY_STREAM: capture, SIDE: side}[s])

    def fork():
        on_event_record(tracer, 1, REPLAY_STREAM)
        on_event_wait(tracer, 1, SIDE)

    if not fork_after_producer:
        fork()
    captured(tracer, cap, 0, "aten::sigmoid_", [], [(0, 0x2000, 64)])
    if fork_after_producer:
        fork()
    current["stream"] = SIDE
    captured(tracer, cap, 0, "aten::mul.out", [(0, 0x2000, 64)], [(0, 0x3000, 64)])
    current["stream"] = REPLAY_STREAM
    on_event_record(tracer, 2, SIDE)  # the join
    on_event_wait(tracer, 2, REPLAY_STREAM)
    captured(tracer, cap, 0, "aten::add_.Tensor", [(0, 0x3000, 64)], [(0, 0x4000, 64)])
    end_capture(tracer, Graph())
    return capture, side


@pytest.mark.parametrize("fork_after_producer", [False, True], ids=["forked-too-early", "forked-after"])
def test_a_race_between_nodes_of_one_graph(traced, monkeypatch, fork_after_producer):
    """A race inside a graph happens at every replay, wherever the graph is replayed: found at the capture, between
    the captured ops, with the capture's stream order and event edges as the graph's dependencies."""
    tracer, analyzer = traced
    capture, side = _fork_join_capture(tracer, monkeypatch, fork_after_producer)
    graphs = [ev for ev in tracer.buffer.events if ev[0] == E.GRAPH]
    assert [[n[0] for n in g[1]] for g in graphs] == [[E.EVENT_RECORD, E.EVENT_WAIT, E.OP, E.OP, E.EVENT_RECORD,
                                                       E.EVENT_WAIT, E.OP] if not fork_after_producer else
                                                      [E.OP, E.EVENT_RECORD, E.EVENT_WAIT, E.OP, E.EVENT_RECORD,
                                                       E.EVENT_WAIT, E.OP]]
    tracer.stop()
    analyzer.finish()
    got = [(f.kind, f.previous.agent, f.previous.name, f.current.agent, f.current.name)
           for f in analyzer.sorted_findings()]
    assert got == ([] if fork_after_producer else [(DEVICE_DEVICE, capture, "aten::sigmoid_", side, "aten::mul.out")])
    assert all(analyzer.contexts[f.current.ctx] == GRAPH_CONTEXT for f in analyzer.sorted_findings())


def test_a_graph_on_one_stream_adds_no_event(traced):
    tracer, analyzer = traced
    tracer.graphs.current = ([], [], True, [])
    tracer.tracing = False
    cap = tracer.graphs.current
    captured(tracer, cap, 0, "aten::fill_.Scalar", [], [(0, 0x2000, 64)])
    captured(tracer, cap, 0, "aten::mul.Tensor", [(0, 0x2000, 64)], [(0, 0x3000, 64)])
    end_capture(tracer, Graph())
    assert [ev for ev in tracer.buffer.events if ev[0] == E.GRAPH] == []


def test_graph_nodes_are_checked_against_each_other_only():
    """The nodes' accesses stay out of the program's own analysis (each replay carries them there), and the
    program's accesses before the graph do not race with them."""
    a = Analyzer()
    a.feed([E.stream(1, 0, 0x10), E.stream(2, 0, 0x20),
            E.op(2, "aten::fill_.Scalar", writes=[(0, 0x2000, 64)]),  # the program, unordered with stream 1
            E.graph([E.op(1, "aten::mul.Tensor", reads=[(0, 0x2000, 64)], writes=[(0, 0x3000, 64)]),
                     E.event_record(5, 1), E.event_wait(5, 2),
                     E.op(2, "aten::add.Tensor", reads=[(0, 0x3000, 64)], writes=[(0, 0x4000, 64)])]),
            E.op(1, "aten::cos.default", reads=[(0, 0x3000, 64)])])  # the graph's writes are not the program's
    a.finish()
    assert a.sorted_findings() == []


def test_a_graph_event_is_validated():
    ev = E.validate([E.GRAPH, [[E.OP, 1, "aten::mul.Tensor", [[0, 4096, 64]], [], 0, 0, 0], [E.EVENT_RECORD, 5, 1, 0]]])
    assert ev == (E.GRAPH, ((E.OP, 1, "aten::mul.Tensor", ((0, 4096, 64),), (), 0, 0, 0), (E.EVENT_RECORD, 5, 1, 0)))
    with pytest.raises(E.BadEvent, match="GRAPH nodes"):
        E.validate([E.GRAPH, [[E.ALLOC, 0, 4096, 64, 1, 0, 0, ""]]])
