"""CUDA graphs as the torch tracer sees them: the ops captured into a graph (kept as its accesses, and as its nodes
for the check between them), and each replay, one op on the replaying stream, or, where the graph records or waits
for external events, a sequence of ops, records and waits there (:mod:`.graph_events`).
"""

from __future__ import annotations

import weakref

from ... import events as E
from ..graphs import GraphAccesses
from . import device
from .graph_events import OP_CHUNK, RECORD, replay_plan
from .host_memory import learn_pinned
from .tensors import PLAIN, args_ranges, output_ranges, subclass_kind

GRAPH_NOTE = ("CUDA graphs: a replay is checked as one access, on the stream it runs on, of the memory its "
              "captured aten ops and Triton kernels touch, and ops captured on several streams against each other "
              "(the capture's events are the graph's edges); kernels of native extensions captured into a graph "
              "are not seen")
CAPTURE_STREAM = "graph capture stream"  # the name of a capture's stream that has none (torch.cuda.graph's own)
GRAPH_CONTEXT = "captured in a CUDA graph: a race between its nodes happens at every replay"
GRAPH_UNTRACKED = "CUDA graphs: a graph captured while streamsan was not tracing it is replayed unanalyzed"


class GraphCaptures:
    """CUDA graphs' accesses: the capture in progress, and each captured graph's for its replays."""

    __slots__ = ("current", "accesses", "external_events", "plans", "_kept_plans")

    def __init__(self):
        # while a graph is captured: (its reads, its writes, whether tracing was on, its nodes: OP, EVENT_RECORD
        # and EVENT_WAIT events in capture order)
        self.current = None
        self.accesses = GraphAccesses()
        self.external_events = weakref.WeakSet()  # the torch.cuda.Event(external=True) made while tracing
        self.plans = weakref.WeakKeyDictionary()  # graph -> its replay plan, where it has external events
        self._kept_plans: dict = {}  # id(graph) -> (graph, plan), for a graph type without weak references

    def external_handles(self) -> set:
        """The CUDA event handles of the external events (0: one not created yet)."""
        return {getattr(e, "cuda_event", 0) for e in list(self.external_events)} - {0}

    def put_plan(self, graph, plan) -> None:
        try:
            self.plans[graph] = plan
        except TypeError:
            self._kept_plans[id(graph)] = (graph, plan)

    def plan(self, graph):
        try:
            plan = self.plans.get(graph)
        except TypeError:
            plan = None
        if plan is None:
            kept = self._kept_plans.get(id(graph))
            plan = kept[1] if kept is not None and kept[0] is graph else None
        return plan


def end_capture(tracer, graph) -> None:
    """A capture ended (``graph`` None: it failed to begin): tracing goes on as before it, and the graph
    keeps the accesses of its captured ops."""
    graphs = tracer.graphs
    cap, graphs.current = graphs.current, None
    if cap is None:
        return
    reads, writes, was_tracing, nodes = cap
    tracer.tracing = was_tracing and tracer.running and not tracer.stopped_on_bug
    dev = next((r[0] for r in writes + reads if r[0] >= 0), -1)
    if graph is None or dev < 0:
        return
    graphs.accesses.put(graph, dev, reads, writes)
    if graphs.external_events:
        plan = replay_plan(nodes, graphs.external_handles())
        if plan is not None:
            graphs.put_plan(graph, plan)
    if tracer.tracing and len({n[2] if n[0] != E.OP else n[1] for n in nodes}) > 1:  # nodes on several streams
        tracer.emit((E.GRAPH, tuple(nodes)))


def dispatch_captured(tracer, func, types, args, kwargs):
    """An op while a CUDA graph is captured: on CUDA memory it becomes a node of the graph and does not run
    now, so its accesses are kept for the graph's replays; an op on pinned host memory only runs now, on the
    host."""
    if types and subclass_kind(types) != PLAIN:
        return func(*args, **kwargs)
    plan = tracer.plans.get(id(func)) or tracer.plan(func)
    if plan.pinning_or_copy:
        learn_pinned(tracer, plan, args, kwargs)
    out = func(*args, **kwargs)
    if plan.skip:
        return out
    reads, writes = args_ranges(tracer, plan, args, kwargs)
    if plan.fresh_outputs:
        output_ranges(tracer, out, writes)
    cap = tracer.graphs.current
    dev = next((r[0] for r in reads + writes if r[0] >= 0), -1)
    if cap is not None and dev >= 0:
        captured(tracer, cap, dev, plan.name, reads, writes)
    elif reads or writes:
        tracer.emit((E.OP, E.HOST, plan.name, tuple(reads), tuple(writes),
                    tracer.stacks.capture(tracer.buffer.events, 3), tracer.ctx, 0))
    return out


def captured(tracer, cap, dev: int, name: str, reads, writes) -> None:
    """An op captured into the graph ``cap`` on the stream current now: its accesses are the graph's (each
    replay's), and it is one of the graph's nodes."""
    cap[0].extend(reads)
    cap[1].extend(writes)
    ctx = tracer.ctx or tracer.buffer.context_id(GRAPH_CONTEXT)
    cap[3].append((E.OP, tracer.agent(dev, device.raw_stream(dev)), name, tuple(reads), tuple(writes),
                   tracer.stacks.capture(tracer.buffer.events, 4), ctx, 0))


def replay(tracer, graph) -> None:
    """``graph.replay()``: one op on the replaying stream that accesses all its captured ops accessed (the
    graph runs as a unit in that stream's order)."""
    acc = tracer.graphs.accesses.get(graph)
    if acc is None:
        tracer.note_once("graph-untracked", GRAPH_UNTRACKED)
        return
    dev, reads, writes = acc
    a = tracer.agent(dev, device.raw_stream(dev))
    tracer.saw_cuda = True
    tracer.index_values.written(writes)
    stack = tracer.stacks.capture(tracer.buffer.events, 2)
    plan = tracer.graphs.plan(graph)
    if plan is None:
        tracer.emit((E.OP, a, "CUDAGraph.replay", reads, writes, stack, tracer.ctx, 0))
        return
    for item in plan:  # (the graph's own event records and waits, in the replaying stream's order)
        if item[0] == OP_CHUNK:
            tracer.emit((E.OP, a, "CUDAGraph.replay", item[1], item[2], stack, tracer.ctx, 0))
        else:
            tracer.emit((E.EVENT_RECORD if item[0] == RECORD else E.EVENT_WAIT, item[1], a, stack))
