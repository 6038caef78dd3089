"""``torch.tensor(data, device="cuda")`` and ``torch.as_tensor``: their copy to the device runs where the dispatch
mode does not look; the values of a small integer tensor made so are known from ``data``
(:mod:`streamsan.tracers.indices`).
"""

from __future__ import annotations

import torch

from .. import device
from .attributes import Replaced

_Tensor = torch.Tensor


def install(tracer):
    """Patch ``torch.tensor`` and ``torch.as_tensor``; returns the undo."""
    replaced = Replaced()
    for name in ("tensor", "as_tensor"):
        orig = getattr(torch, name, None)
        if orig is None:
            continue

        def make(orig):
            def factory(data, *a, **k):
                out = orig(data, *a, **k)
                if tracer.tracing and out is not data and out.__class__ is _Tensor and getattr(out, device.ATTR):
                    try:
                        tracer.index_values.learn_data(out, data)
                    except Exception as exc:
                        tracer.stop_on_bug(exc, "torch.tensor")
                return out
            factory.__wrapped__ = orig
            factory.__doc__ = orig.__doc__
            return factory

        replaced.add(torch, name, orig)
        setattr(torch, name, make(orig))
    return replaced.undo
