"""Patch: CUDA graphs on CuPy streams. ``begin_capture`` / ``end_capture`` start and end a capture
(:mod:`..captures`: the streams that join it, its nodes, a capture that fails runs nothing). A successful
``end_capture`` returns the graph wrapped in a :class:`TracedGraph` (``Graph`` is an extension type whose
``launch`` cannot be replaced), whose ``launch(stream)`` is one op on that stream (the current one when none is
given) over all the capture's accesses; a capture on several streams is also checked inside, once, as a
``GRAPH`` event (:mod:`streamsan.tracers.graphs`)."""

from __future__ import annotations

import functools

from .... import events as E
from ...graphs import graph_event
from .. import active
from ..patching import Patches

GRAPH_NOTE = ("CuPy CUDA graphs: a launch is checked as one access, on the stream it runs on, of the memory its "
              "captured calls touch, and calls captured on several streams against each other (the capture's "
              "events are the graph's edges); work captured by calls streamsan does not trace is not seen")
LAUNCH = "cupy.cuda.Graph.launch"


def install(tracer):
    patches = Patches(tracer, "graphs")
    with patches:
        S = tracer.cp.cuda.stream
        t = tracer

        def m_begin(orig):
            def begin_capture(s, *args, **kwargs):
                r = orig(s, *args, **kwargs)
                if t.running:
                    t._note_once(GRAPH_NOTE)
                    dev, a = t._stream_agent(s)
                    t.captures.begin(a, dev)
                return r
            return functools.wraps(orig)(begin_capture)

        def m_end(orig):
            def end_capture(s, *args, **kwargs):
                ok = False
                try:
                    g = orig(s, *args, **kwargs)
                    ok = True
                finally:
                    cap = t.captures.end(t._stream_agent(s)[1], ok) if t.running else None
                if cap is None or g is None:
                    return g
                return t.captured_graph(g, cap)
            return functools.wraps(orig)(end_capture)

        for cls in (S._BaseStream, S.Stream):
            for attr, make in (("begin_capture", m_begin), ("end_capture", m_end)):
                if attr in vars(cls):
                    patches.wrap(cls, attr, make)
    return patches.undo


def ended(tracer, graph, cap):
    """A capture that gave ``graph``: its nodes on several streams are checked against each other now, and the
    graph keeps its accesses for its launches."""
    tracer.graphs.put(graph, cap.device, cap.reads, cap.writes)
    ev = graph_event(cap.nodes)
    if ev is not None:
        tracer._emit(ev)


def launched(tracer, graph, stream) -> None:
    """``graph.launch(stream)`` returned: one op on that stream (the current one for None) over everything the
    capture accessed, in that stream's order; inside another capture, a node of it."""
    acc = tracer.graphs.get(graph)
    if acc is None or not (acc[1] or acc[2]):
        return
    _dev, reads, writes = acc
    dev, a = tracer._stream_agent(stream)
    stack = tracer._stack(3)
    if tracer.captures.call(a, LAUNCH, reads, writes, stack, tracer.ctx):
        return
    tracer.saw_cuda = True
    if writes and tracer.staged.kept:
        tracer.staged.forget(writes)
    tracer._emit((E.OP, a, LAUNCH, reads, writes, stack, tracer.ctx, 0))


class TracedGraph:
    """A ``cupy.cuda.Graph`` from a traced capture: ``launch`` is traced, everything else is the graph's
    (``isinstance(g, cupy.cuda.Graph)`` still holds)."""

    def __init__(self, graph):
        self._graph = graph

    def launch(self, stream=None):
        out = self._graph.launch(stream)
        t = active.tracer
        if t is not None and t.running and t._ops_on() and not getattr(t._tl, "depth", 0):
            try:
                launched(t, self, stream)
            except Exception as e:
                t._trouble(f"{LAUNCH}: {type(e).__name__}: {e}")
        return out

    def __getattr__(self, item):
        return getattr(self._graph, item)

    @property
    def __class__(self):
        return type(self._graph)

    def __repr__(self):
        return repr(self._graph)
