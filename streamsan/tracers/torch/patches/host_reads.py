"""Host reads that launch no aten op: ``Tensor.tolist()``, ``Tensor.numpy()`` (also reached by ``np.asarray(t)``)
and ``torch.save``, on pinned memory.

``tolist()`` reads a pinned tensor's memory when it is called. ``numpy()`` only makes a view, read later through
the array (:func:`..host_memory.open_view`): its reads and writes are seen when they happen, and the view also
counts as one host read at the latest moment the program can read through it, when the array (and every view of
it) is gone, or when tracing stops. So ``np.asarray(t).sum()`` before a synchronization races, and a view made
while a copy runs and read after ``event.synchronize()`` (vLLM's asynchronous outputs) does not. ``torch.save``
reads the pinned tensors it serializes (in C++, without an aten op).
"""

from __future__ import annotations

import torch

from ..host_memory import host_read, open_view
from ..tensors import tensors_in
from .attributes import Replaced


def install(tracer):
    """Patch ``Tensor.tolist``, ``Tensor.numpy`` and ``torch.save``; returns the undo."""
    replaced = Replaced()
    for attr in ("tolist", "numpy"):
        orig = getattr(torch.Tensor, attr, None)
        if orig is None:
            continue

        def make(orig, name):
            def read(self, *a, **k):
                out = orig(self, *a, **k)  # a call that raises read nothing
                if tracer.pinned and tracer.tracing and self.is_cpu:
                    try:
                        if name == "Tensor.numpy":
                            out = open_view(tracer, self, out)
                        else:
                            host_read(tracer, self, name)
                    except Exception as exc:
                        tracer.stop_on_bug(exc, name)
                return out
            read.__wrapped__ = orig
            read.__doc__ = orig.__doc__
            return read

        replaced.add(torch.Tensor, attr, torch.Tensor.__dict__.get(attr))
        setattr(torch.Tensor, attr, make(orig, f"Tensor.{attr}"))
    serialization = getattr(torch, "serialization", None)
    orig_save = getattr(serialization, "save", None)
    if orig_save is not None:
        def save(obj, *a, **k):
            """``torch.save`` reads the pinned tensors it serializes (in C++, without an aten op)."""
            if tracer.pinned and tracer.tracing and tracer.in_scope:
                try:
                    for t in tensors_in(obj):
                        if t.is_cpu:
                            host_read(tracer, t, "torch.save")
                except Exception as exc:
                    tracer.stop_on_bug(exc, "torch.save")
            return orig_save(obj, *a, **k)
        save.__wrapped__ = orig_save
        for owner in (torch, serialization):
            if getattr(owner, "save", None) is orig_save:
                replaced.add(owner, "save", orig_save)
                owner.save = save
    return replaced.undo
