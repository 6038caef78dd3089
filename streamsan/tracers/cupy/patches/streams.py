"""Patch: CuPy's stream methods. ``synchronize`` and ``done`` (when True) are host synchronizations with the
stream, ``record`` / ``wait_event`` record and wait events (on a capturing stream: nodes of its graph), and ``Stream.__init__`` declares a newly created stream
(a new agent, with its real flags, named after what its creating line assigns it to).

The current stream is read at each traced call, so ``use()`` and ``with stream:`` need no patch.
"""

from __future__ import annotations

import functools

from .... import events as E
from ...naming import caller_name
from ..patching import Patches


def install(tracer):
    patches = Patches(tracer, "streams")
    with patches:
        S = tracer.cp.cuda.stream
        Base, Stream = S._BaseStream, S.Stream
        t = tracer
        ev = tracer._emit

        def m_sync(orig):
            def synchronize(s):
                r = orig(s)
                if t.running:
                    dev, a = t._stream_agent(s)
                    ev((E.STREAM_SYNC, a, t._stack()))
                return r
            return functools.wraps(orig)(synchronize)

        def m_record(orig):
            def record(s, event=None):
                e = orig(s, event)
                if t.running:
                    dev, a = t._stream_agent(s)
                    t._event_record(int(e.ptr), a, t._stack())
                return e
            return functools.wraps(orig)(record)

        def m_wait(orig):
            def wait_event(s, event):
                r = orig(s, event)
                if t.running:
                    dev, a = t._stream_agent(s)
                    t._event_wait(int(event.ptr), a, t._stack())
                return r
            return functools.wraps(orig)(wait_event)

        def m_done(orig):
            def done(s):
                d = orig.fget(s)
                if d and t.running:
                    dev, a = t._stream_agent(s)
                    ev((E.STREAM_SYNC, a, t._stack()))
                return d
            return property(done, doc=orig.__doc__)

        def m_init(orig):
            def __init__(s, *args, **kwargs):
                orig(s, *args, **kwargs)
                if t.running:
                    h = int(s.ptr)
                    if h > 2:  # a new CUDA stream: a new agent, even if a destroyed stream had its handle
                        dev = s.device_id if s.device_id >= 0 else t._getDevice()
                        t._new_stream(dev, h, None)
                        name = caller_name()
                        if name:
                            t.streams.name_created(dev, h, name)
            return functools.wraps(orig)(__init__)

        patches.wrap(Base, "synchronize", m_sync)
        patches.wrap(Base, "record", m_record)
        patches.wrap(Base, "wait_event", m_wait)
        patches.wrap(Base, "done", m_done)
        patches.wrap(Stream, "__init__", m_init)
    return patches.undo
