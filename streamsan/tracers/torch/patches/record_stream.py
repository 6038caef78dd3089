"""``Tensor.record_stream`` where the dispatch mode cannot see it (under ``no_dispatch()``, as FSDP calls it): handled
here when the mode did not see the call.
"""

from __future__ import annotations

import threading

import torch

from ..dispatch import record_stream as recorded
from .attributes import Replaced

_get_ident = threading.get_ident


def install(tracer):
    """Patch ``Tensor.record_stream``; returns the undo."""
    replaced = Replaced()
    orig_record = torch.Tensor.__dict__.get("record_stream") or getattr(torch.Tensor, "record_stream", None)
    if orig_record is not None:
        def record_stream(t, stream):
            tracer.record_stream_seen = None
            out = orig_record(t, stream)
            if tracer.tracing and tracer.in_scope and tracer.record_stream_seen != _get_ident():
                try:
                    recorded(tracer, (t, stream))
                except Exception as exc:
                    tracer.stop_on_bug(exc, "Tensor.record_stream")
            return out
        record_stream.__wrapped__ = orig_record
        record_stream.__doc__ = orig_record.__doc__
        replaced.add(torch.Tensor, "record_stream", torch.Tensor.__dict__.get("record_stream"))
        torch.Tensor.record_stream = record_stream
    return replaced.undo
