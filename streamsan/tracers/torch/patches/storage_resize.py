"""``UntypedStorage.resize_`` (not an aten op, as FSDP calls it): allocating a storage's new block (sized here, on
the current stream), copying the old bytes over (a read and a write on that stream) and freeing the old block.
"""

from __future__ import annotations

import torch

from .... import events as E
from .. import device
from ..allocators import ALLOCATOR, allocations_unreported
from ..placement import commit, run_inside
from .attributes import Replaced


def install(tracer):
    """Patch ``UntypedStorage.resize_``; returns the undo."""
    replaced = Replaced()
    storage = getattr(torch, "UntypedStorage", None)
    orig_resize = getattr(storage, "resize_", None)
    if orig_resize is not None:
        def resize_(st, size):
            if not (tracer.tracing and tracer.in_scope and getattr(st, device.ATTR)):
                return orig_resize(st, size)
            return resize(tracer, orig_resize, st, size)
        resize_.__wrapped__ = orig_resize
        resize_.__doc__ = orig_resize.__doc__
        replaced.add(storage, "resize_", storage.__dict__.get("resize_"))
        storage.resize_ = resize_
    return replaced.undo


def resize(tracer, orig, st, size):
    """Run ``orig(st, size)``, a device storage's resize, as one op of its own."""
    try:
        dev = st.device.index
        old_ptr, old_n = st.data_ptr(), st.nbytes()
        stack = tracer.stacks.outside(tracer.buffer.events)
    except Exception as exc:
        tracer.stop_on_bug(exc, "UntypedStorage.resize_")
        return orig(st, size)
    out, a, evs, mark = run_inside(tracer, orig, (st, size), {}, dev, stack)
    try:
        _place_resize(tracer, evs, mark, st, a, dev, old_ptr, old_n, stack)
        commit(tracer, evs)
    except Exception as exc:
        tracer.stop_on_bug(exc, "UntypedStorage.resize_")
    return out


def _place_resize(tracer, evs, mark, st, a, dev, old_ptr, old_n, stack) -> None:
    """The events of a storage resize: its new block's allocation (sized), the copy of the old bytes on the
    current stream, then the old block's free."""
    new_ptr, new_n = st.data_ptr(), st.nbytes()
    inner = evs[mark:]
    del evs[mark:]
    allocs = [ev for ev in inner if ev[0] == E.ALLOC]
    if new_ptr != old_ptr and ALLOCATOR.unreported is not False and allocations_unreported(tracer):
        # (the allocator reports neither the new block nor the old one's free: the resize does both)
        if ALLOCATOR.resized(tracer, old_ptr):
            inner.append((E.FREE, dev, old_ptr, 0))
        if new_n:
            allocs = [(E.ALLOC, dev, new_ptr, new_n, a, stack, tracer.ctx, "storage", E.UNREPORTED_POOL)]
            ALLOCATOR.watch(tracer, dev, new_ptr, st)
    for i, ev in enumerate(allocs):
        if ev[2] == new_ptr and ev[3] == 0:
            allocs[i] = (E.ALLOC, ev[1], ev[2], new_n, ev[4], ev[5], ev[6], "storage") + ev[8:]
    evs.extend(allocs)
    keep = min(old_n, new_n)
    if keep and old_ptr != new_ptr:
        evs.append((E.OP, a, "UntypedStorage.resize_", ((dev, old_ptr, keep),), ((dev, new_ptr, keep),),
                    stack, tracer.ctx, 0))
    evs.extend(ev for ev in inner if ev[0] != E.ALLOC)
