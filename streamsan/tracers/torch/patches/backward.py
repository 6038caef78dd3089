"""``backward()`` / ``torch.autograd.grad()``: where they are called, for the stacks of the backward ops the autograd
engine runs in its own threads (:mod:`..engine`).
"""

from __future__ import annotations

import torch

from .attributes import Replaced


def install(tracer):
    """Patch ``torch.autograd.backward`` and ``torch.autograd.grad``; returns the undo."""
    replaced = Replaced()
    autograd = getattr(torch, "autograd", None)
    for attr in ("backward", "grad"):
        orig = getattr(autograd, attr, None)
        if orig is None:
            continue

        def make(orig):
            def call(*a, **k):
                if tracer.tracing:
                    tracer.backward_site = tracer.stacks.frames_here(1)
                return orig(*a, **k)
            call.__wrapped__ = orig
            call.__doc__ = orig.__doc__
            return call

        replaced.add(autograd, attr, orig)
        setattr(autograd, attr, make(orig))
    return replaced.undo
