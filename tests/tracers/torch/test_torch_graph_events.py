"""External events in CUDA graph captures (``torch.cuda.Event(external=True)``), on the CPU: the replay plan of a
capture's nodes (pure), and the tracer's replay with the capture's bookkeeping driven by hand, as in
tests/test_torch_graphs.py, checked by the analyzer. The GPU half is tests/gpu/test_graph_events_and_releases.py."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.analysis.findings import HOST_DEVICE  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch import cuda_graphs, device  # noqa: E402
from streamsan.tracers.torch.cuda_graphs import end_capture  # noqa: E402
from streamsan.tracers.torch.graph_events import OP_CHUNK, RECORD, WAIT, replay_plan  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402

CAP, SIDE = 1, 2  # agents of the capture stream and a side stream joined into the capture
START, END, FORK, JOIN = 0xE1, 0xE2, 0xF1, 0xF2  # event handles
DEV = (0, 0x1000, 64)
PIN_A, PIN_B = (E.PINNED, 0x9000, 64), (E.PINNED, 0x9100, 64)


def copy(agent, dst, src=DEV):
    return E.op(agent, "aten::copy_", reads=[src], writes=[dst])


def test_no_external_event_no_plan():
    nodes = [copy(CAP, PIN_A), E.event_record(END, CAP)]
    assert replay_plan(nodes, set()) is None


def test_a_record_after_the_ops_that_precede_it_and_a_wait_before_those_that_follow():
    nodes = [E.event_wait(START, CAP), copy(CAP, PIN_A), E.event_record(END, CAP), copy(CAP, PIN_B)]
    assert replay_plan(nodes, {START, END}) == (
        (WAIT, START), (OP_CHUNK, (DEV,), (PIN_A,)), (RECORD, END), (OP_CHUNK, (DEV,), (PIN_B,)))
    # only END external: START's wait is an edge of the capture, nothing at the replay
    assert replay_plan(nodes, {END}) == (
        (OP_CHUNK, (DEV,), (PIN_A,)), (RECORD, END), (OP_CHUNK, (DEV,), (PIN_B,)))


def test_a_record_on_a_forked_branch_orders_only_its_branch():
    # the capture forks to SIDE (FORK), SIDE copies to PIN_B and records END; CAP copies to PIN_A meanwhile; joined
    nodes = [E.event_record(FORK, CAP), E.event_wait(FORK, SIDE), copy(CAP, PIN_A), copy(SIDE, PIN_B),
             E.event_record(END, SIDE), E.event_record(JOIN, SIDE), E.event_wait(JOIN, CAP)]
    # END follows SIDE's copy but not CAP's, which comes first in capture order: END goes before both
    assert replay_plan(nodes, {END}) == ((RECORD, END), (OP_CHUNK, (DEV,), (PIN_A, PIN_B)))
    # captured in the other order, END's place is after SIDE's copy and before CAP's
    nodes = [E.event_record(FORK, CAP), E.event_wait(FORK, SIDE), copy(SIDE, PIN_B), E.event_record(END, SIDE),
             copy(CAP, PIN_A), E.event_record(JOIN, SIDE), E.event_wait(JOIN, CAP)]
    assert replay_plan(nodes, {END}) == (
        (OP_CHUNK, (DEV,), (PIN_B,)), (RECORD, END), (OP_CHUNK, (DEV,), (PIN_A,)))


def test_a_wait_on_a_side_branch_comes_after_the_ops_that_do_not_follow_it():
    nodes = [E.event_record(FORK, CAP), E.event_wait(FORK, SIDE), E.event_wait(START, SIDE), copy(CAP, PIN_A),
             copy(SIDE, PIN_B), E.event_record(JOIN, SIDE), E.event_wait(JOIN, CAP)]
    assert replay_plan(nodes, {START}) == (
        (OP_CHUNK, (DEV,), (PIN_A,)), (WAIT, START), (OP_CHUNK, (DEV,), (PIN_B,)))


REPLAY_STREAM = 0x5000


class Graph:
    """Stands for a torch.cuda.CUDAGraph."""


class ExternalEvent:
    """Stands for a torch.cuda.Event(external=True) once recorded."""

    def __init__(self, handle):
        self.cuda_event = handle


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


def capture(tracer, nodes):
    g = Graph()
    reads = [r for n in nodes if n[0] == E.OP for r in n[3]]
    writes = [r for n in nodes if n[0] == E.OP for r in n[4]]
    tracer.graphs.current = (reads, writes, True, nodes)
    tracer.tracing = False
    end_capture(tracer, g)
    return g


@pytest.mark.parametrize("external", [True, False], ids=["external", "internal"])
def test_host_read_after_the_replay_and_the_captured_record(traced, external):
    # a device-to-pinned copy and end_event.record() captured; replayed; end_event.synchronize(); the host reads
    # the copy's destination: ordered by the replay's record node when the event is external, else a race
    tracer, analyzer = traced
    end = ExternalEvent(END)
    if external:
        tracer.graphs.external_events.add(end)
    cap = tracer.agent(0, REPLAY_STREAM)
    g = capture(tracer, [copy(cap, PIN_A), E.event_record(END, cap)])
    cuda_graphs.replay(tracer, g)
    tracer.buffer.events += [E.event_sync(END), E.host_access("numpy", reads=[PIN_A])]
    tracer.stop()
    found = [(f.kind, f.previous.name, f.current.name) for f in analyzer.sorted_findings()]
    assert found == ([] if external else [(HOST_DEVICE, "CUDAGraph.replay", "numpy")])


@pytest.mark.parametrize("external", [True, False], ids=["external", "internal"])
def test_a_captured_wait_orders_the_replay_after_the_program_record(traced, external):
    # another stream fills the graph's input and records start_event; the graph waits for start_event first
    # (captured), then copies the input: ordered when the wait is external
    tracer, analyzer = traced
    start = ExternalEvent(START)
    if external:
        tracer.graphs.external_events.add(start)
    cap = tracer.agent(0, REPLAY_STREAM)
    other = tracer.agent(0, 0x6000)
    g = capture(tracer, [E.event_wait(START, cap), copy(cap, PIN_A)])
    tracer.buffer.events += [E.op(other, "aten::fill_", writes=[DEV]), E.event_record(START, other)]
    cuda_graphs.replay(tracer, g)
    tracer.stop()
    found = [(f.kind, f.previous.name, f.current.name) for f in analyzer.sorted_findings()]
    assert found == ([] if external else [("device-device", "aten::fill_", "CUDAGraph.replay")])


def test_external_events_are_learnt_when_made(monkeypatch):
    class Event:  # a stand-in of torch.cuda.Event's Python class (the CPU build cannot make one)
        def __new__(cls, enable_timing=False, blocking=False, interprocess=False, external=False):
            return object.__new__(cls)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    orig = Event.__dict__["__new__"]
    tracer = TorchTracer(EventBuffer([lambda events: None]))
    tracer.start()
    try:
        by_keyword, by_position, plain = Event(external=True), Event(False, False, False, True), Event()
        assert set(tracer.graphs.external_events) == {by_keyword, by_position}
        assert isinstance(plain, Event)
    finally:
        tracer.stop()
    assert Event.__dict__["__new__"] is orig
