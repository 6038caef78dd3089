"""``torch.cuda.Stream()``: a new stream is named after what its creating line assigns it to
(:mod:`streamsan.tracers.naming`). Wrapping an existing stream (``stream_id=``, as ``current_stream()`` does) is
no creation.
"""

from __future__ import annotations

import torch

from ...naming import caller_name
from .. import device
from .attributes import Replaced


def install(tracer):
    """Patch ``torch.cuda.Stream.__new__``; returns the undo."""
    replaced = Replaced()
    cls = getattr(getattr(torch, "cuda", None), "Stream", None)
    orig = vars(cls).get("__new__") if cls is not None else None
    if orig is None:
        return replaced.undo
    make = orig.__func__ if isinstance(orig, staticmethod) else orig

    def __new__(klass, *a, **k):
        stream = make(klass, *a, **k)
        if tracer.tracing and "stream_id" not in k:
            try:
                name = caller_name()
                if name:
                    dev, handle = device.stream_key(stream)
                    tracer.streams.name_created(dev, handle, name)
            except Exception as exc:
                tracer.stop_on_bug(exc, "torch.cuda.Stream()")
        return stream
    __new__.__wrapped__ = make
    __new__.__doc__ = make.__doc__

    replaced.add(cls, "__new__", orig)
    cls.__new__ = staticmethod(__new__)
    return replaced.undo
