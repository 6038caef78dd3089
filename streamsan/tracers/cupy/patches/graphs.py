"""Patch: CUDA graph capture on CuPy streams (``begin_capture`` / ``end_capture``). While a stream captures,
the calls on it are nodes of the graph, not work that runs now: the tracer emits no op for them and no event
record or wait on that stream. Neither the captured calls nor the graph's launches are analyzed (``Graph`` is an
extension type whose ``launch`` cannot be intercepted); :data:`GRAPH_NOTE` says so in the report."""

from __future__ import annotations

import functools

from ..patching import Patches

GRAPH_NOTE = ("CuPy CUDA graphs: calls captured into a graph (Stream.begin_capture) and the graph's launches are "
              "not analyzed")


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
                    t.capturing.add(t._stream_agent(s)[1])
                return r
            return functools.wraps(orig)(begin_capture)

        def m_end(orig):
            def end_capture(s, *args, **kwargs):
                try:
                    return orig(s, *args, **kwargs)
                finally:
                    if t.running:
                        t.capturing.discard(t._stream_agent(s)[1])
            return functools.wraps(orig)(end_capture)

        for cls in (S._BaseStream, S.Stream):
            for attr, make in (("begin_capture", m_begin), ("end_capture", m_end)):
                if attr in vars(cls):
                    patches.wrap(cls, attr, make)
    return patches.undo
