"""``torch.cuda.CUDAGraph``: ops during a capture are recorded into the graph, not run, so their accesses are kept
for the graph's replays (:mod:`..cuda_graphs`); each ``replay()`` is one op on the replaying stream, with the records
and waits of the external events it captured (``torch.cuda.Event(external=True)``, learnt when made).
"""

from __future__ import annotations

import torch

from .. import device
from ..cuda_graphs import CAPTURE_STREAM, GRAPH_NOTE, end_capture, replay
from .attributes import Replaced

_DisableTorchDispatch = torch._C._DisableTorchDispatch  # (thread-local: dispatch modes skipped in its block)


def install(tracer):
    """Patch ``CUDAGraph.capture_begin``, ``capture_end`` and ``replay``; returns the undo."""
    replaced = Replaced()
    graphs = getattr(getattr(torch, "cuda", None), "graphs", None)
    cls = getattr(graphs, "CUDAGraph", None) if graphs is not None else None
    if cls is None:
        return replaced.undo
    begin, end, graph_replay_orig = (cls.__dict__.get(n) for n in ("capture_begin", "capture_end", "replay"))

    def capture_begin(self, *a, **k):
        tracer.note_once("graph", GRAPH_NOTE)
        tracer.graphs.current = ([], [], tracer.tracing, [])
        tracer.tracing = False
        try:
            with _DisableTorchDispatch():  # (see graph_replay)
                out = begin(self, *a, **k)
            if tracer.graphs.current[2]:
                dev = device.current()
                tracer.streams.name_unnamed(dev, device.raw_stream(dev), CAPTURE_STREAM)
            return out
        except BaseException:
            end_capture(tracer, None)
            raise

    def capture_end(self, *a, **k):
        try:
            return end(self, *a, **k)
        finally:
            end_capture(tracer, self)

    def graph_replay(self, *a, **k):
        """The replay's own op. The ops PyTorch runs itself before a capture begins and before each replay
        (the CUDA generators' seed and offset fills, the same memory for every graph) are its
        bookkeeping, not the program's nor the graph's: unseen, in this thread only."""
        if tracer.tracing and tracer.in_scope:
            try:
                replay(tracer, self)
            except Exception as exc:
                tracer.stop_on_bug(exc, "CUDAGraph.replay")
        with _DisableTorchDispatch():
            return graph_replay_orig(self, *a, **k)

    for name, orig, fn in (("capture_begin", begin, capture_begin), ("capture_end", end, capture_end),
                           ("replay", graph_replay_orig, graph_replay)):
        if orig is not None:
            fn.__wrapped__ = orig
            setattr(cls, name, fn)
            replaced.add(cls, name, orig)
    note_external_events(tracer, replaced)
    return replaced.undo


def note_external_events(tracer, replaced) -> None:
    """Patch ``torch.cuda.Event.__new__`` (where it takes ``external``) to keep the external events: their records
    and waits captured into a graph are nodes of it, run at each replay (:mod:`..graph_events`)."""
    cls = getattr(torch.cuda, "Event", None)
    new = cls.__dict__.get("__new__") if cls is not None else None
    orig = getattr(new, "__func__", new)
    code = getattr(orig, "__code__", None)
    if code is None or "external" not in code.co_varnames:
        return
    externals = tracer.graphs.external_events

    def __new__(klass, *args, **kwargs):
        ev = orig(klass, *args, **kwargs)
        if kwargs.get("external", args[3] if len(args) > 3 else False):
            try:
                externals.add(ev)
            except TypeError:  # (an event type without weak references: its replays stay one op)
                pass
        return ev

    __new__.__wrapped__ = orig
    cls.__new__ = staticmethod(__new__)
    replaced.add(cls, "__new__", new)
