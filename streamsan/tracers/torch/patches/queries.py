"""``Event.query()`` and ``Stream.query()`` (on ``torch.cuda`` and on the generic ``torch.Event`` /
``torch.Stream``): one that returns True means the host has waited for the event or stream, which no GPU trace
callback reports.
"""

from __future__ import annotations

import torch

from .... import events as E
from .. import device
from .attributes import Replaced, set_type_attr


def install(tracer):
    """Patch the query methods there are; returns the undo."""
    replaced = Replaced()
    targets = []
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and hasattr(cuda, "Event"):
        targets.append((cuda.Event, "query", "event"))
        targets.append((cuda.Stream, "query", "stream"))
    for cls in (getattr(torch, "Event", None), getattr(torch, "Stream", None)):  # the generic C classes
        if cls is not None and cls.__dict__.get("query") is not None:
            targets.append((cls, "query", "generic " + ("event" if cls is torch.Event else "stream")))
    for cls, attr, what in targets:
        orig = cls.__dict__.get(attr)
        if orig is None:
            continue

        def make(orig, what):
            def query(self):
                done = orig(self)
                if done and tracer.running:
                    try:
                        queried(tracer, self, what)
                    except Exception as exc:
                        tracer.stop_on_bug(exc, f"{what} query()")
                return done
            query.__wrapped__ = orig
            query.__doc__ = orig.__doc__
            return query

        if set_type_attr(cls, attr, make(orig, what)):
            replaced.add(cls, attr, orig)
    return replaced.undo


def queried(tracer, obj, what: str) -> None:
    """A ``query()`` of an event or stream returned True: the host has waited for it."""
    if what.endswith("event"):
        h = getattr(obj, "cuda_event", 0) if what == "event" else \
            (obj.event_id if obj.device.type == "cuda" else 0)
        if h:
            tracer.emit((E.EVENT_SYNC, h, tracer.stacks.capture(tracer.buffer.events, 2)))
    elif what == "stream" or obj.device_type == device.CUDA_TYPE:
        dev, handle = device.stream_key(obj)
        tracer.emit((E.STREAM_SYNC, tracer.agent(dev, handle), tracer.stacks.capture(tracer.buffer.events, 2)))
