"""Patch: CuPy's ``Event``. ``record`` records it on a stream, ``synchronize`` and ``done`` (when True) are host
synchronizations with it, and its deletion ends it."""

from __future__ import annotations

import functools

from .... import events as E
from ..patching import Patches


def install(tracer):
    patches = Patches(tracer, "events")
    with patches:
        Event = tracer.cp.cuda.stream.Event
        t = tracer
        ev = tracer._emit

        def m_record(orig):
            def record(e, stream=None):
                r = orig(e, stream)
                if t.running:
                    dev, a = t._stream_agent(stream)
                    t._event_record(int(e.ptr), a, t._stack())
                return r
            return functools.wraps(orig)(record)

        def m_sync(orig):
            def synchronize(e):
                r = orig(e)
                if t.running:
                    ev((E.EVENT_SYNC, int(e.ptr), t._stack()))
                return r
            return functools.wraps(orig)(synchronize)

        def m_done(orig):
            def done(e):
                d = orig.fget(e)
                if d and t.running:
                    ev((E.EVENT_SYNC, int(e.ptr), t._stack()))
                return d
            return property(done, doc=orig.__doc__)

        def m_del(orig):
            def __del__(e, *args, **kwargs):
                if t.running and getattr(e, "ptr", 0):
                    ev((E.EVENT_DELETE, int(e.ptr)))
                return orig(e, *args, **kwargs)
            return __del__

        patches.wrap(Event, "record", m_record)
        patches.wrap(Event, "synchronize", m_sync)
        patches.wrap(Event, "done", m_done)
        if "__del__" in vars(Event):
            patches.wrap(Event, "__del__", m_del)
    return patches.undo
