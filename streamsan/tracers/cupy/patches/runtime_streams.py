"""Patch: the stream and event calls of ``cupy.cuda.runtime``. ``streamSynchronize``, ``deviceSynchronize``,
``eventSynchronize`` and a successful ``eventQuery`` / ``streamQuery`` are host synchronizations; ``eventRecord``,
``streamWaitEvent`` and ``eventDestroy`` record, wait on and end events; ``streamCreate*`` declares a new stream
with its flags (a new agent, even where a destroyed stream had its handle)."""

from __future__ import annotations

import functools

from .... import events as E
from ..patching import Patches


def install(tracer):
    patches = Patches(tracer, "runtime streams")
    with patches:
        rt = tracer.cp.cuda.runtime
        t = tracer
        ev = tracer._emit

        def sync_fn(orig, make):
            @functools.wraps(orig)
            def f(*args, **kwargs):
                r = orig(*args, **kwargs)
                if t.running:
                    try:
                        e = make(r, *args, *kwargs.values())
                    except Exception as exc:
                        t._trouble(f"{orig.__name__}: {type(exc).__name__}: {exc}")
                        e = None
                    if e is not None:
                        ev(e)
                return r
            return f

        def agent(h):
            return t._stream_agent(int(h))[1]

        emitted = {
            "streamSynchronize": lambda r, s: (E.STREAM_SYNC, agent(s), t._stack(3)),
            "deviceSynchronize": lambda r: (E.DEVICE_SYNC, t._getDevice(), t._stack(3)),
            "eventSynchronize": lambda r, e: (E.EVENT_SYNC, int(e), t._stack(3)),
            "eventQuery": lambda r, e: (E.EVENT_SYNC, int(e), t._stack(3)) if r == 0 else None,
            "streamQuery": lambda r, s: (E.STREAM_SYNC, agent(s), t._stack(3)) if r == 0 else None,
            "eventDestroy": lambda r, e: (E.EVENT_DELETE, int(e)),
        }
        # (on a capturing stream, nodes of its graph: the tracer decides, and emits)
        emitted["eventRecord"] = lambda r, e, s: t._event_record(int(e), agent(s), t._stack(3))
        emitted["streamWaitEvent"] = lambda r, s, e, *f: t._event_wait(int(e), agent(s), t._stack(3))
        for name, make in emitted.items():
            orig = getattr(rt, name, None)
            if orig is not None:
                patches.replace(rt, name, sync_fn(orig, make))

        def creator(orig, flags_of):
            @functools.wraps(orig)
            def f(*args):
                h = orig(*args)
                if t.running and int(h) > 2:
                    t._new_stream(t._getDevice(), int(h), flags_of(args))
                return h
            return f

        for name, flags_of in (("streamCreate", lambda a: E.BLOCKING),
                               ("streamCreateWithFlags", lambda a: 0 if (a[0] if a else 0) & 1 else E.BLOCKING),
                               ("streamCreateWithPriority", lambda a: 0 if (a[0] if a else 0) & 1 else E.BLOCKING)):
            orig = getattr(rt, name, None)
            if orig is not None:
                patches.replace(rt, name, creator(orig, flags_of))
    return patches.undo
