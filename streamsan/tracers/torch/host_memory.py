"""Pinned host memory as the torch tracer sees it: the pinned blocks it learns of, host reads that launch no aten op,
NumPy views of pinned tensors (read at the latest when gone), and the host's unseen writes to pinned staging
buffers before an asynchronous copy out of them.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ... import events as E
from ..pinned_numpy import pinned_class
from ..staging import refill_op
from .tensors import describe, is_pinned, range_in

_STRIDED = torch.strided


class HostViews:
    """NumPy views of pinned memory still open (``t.numpy()`` views, :mod:`..pinned_numpy` views read at the
    latest when gone)."""

    __slots__ = ("opened",)

    def __init__(self):
        self.opened: dict = {}  # id -> (weak reference to a view, its host read to come)


def host_read(tracer, t, name: str) -> None:
    """A host read of a tensor's pinned memory by a call that launches no aten op (``name``)."""
    r = range_in(tracer, t, E.PINNED)
    if r is not None:
        tracer.emit((E.OP, E.HOST, name, (r,), (), tracer.stacks.capture(tracer.buffer.events, 2), tracer.ctx, 0))


def open_view(tracer, t, array):
    """``t.numpy()`` made ``array``: the array to hand out. Over pinned memory, a :mod:`..pinned_numpy`
    view, whose accesses are seen when they happen (made before the copies that use the memory, as vLLM's input
    batches make theirs, it sees them all the same); such a view is also read, at the latest, when it is gone
    (for what the view cannot see: its memory handed to native code; views made by ``np.asarray(t)`` are plain
    arrays over it)."""
    r = range_in(tracer, t, E.PINNED)
    if r is None:
        return array
    array = array.view(pinned_class())
    read = (E.OP, E.HOST, "Tensor.numpy", (r,), (), tracer.stacks.capture(tracer.buffer.events, 2), tracer.ctx, 0)
    try:
        ref = weakref.ref(array, functools.partial(_close_view, tracer))
    except TypeError:  # not an ndarray after all: read now
        tracer.emit(read)
        return array
    tracer.views.opened[id(ref)] = (ref, read)  # the reference lives as long as its entry (arrays are unhashable)
    return array


def _close_view(tracer, ref) -> None:
    entry = tracer.views.opened.pop(id(ref), None)
    if entry is not None and tracer.running:
        tracer.emit(entry[1])


def learn_pinned(tracer, plan, args, kwargs) -> None:
    """Before a copy: find out whether its CPU tensors are pinned blocks not seen being created (pinned
    before tracing started, or by a path the tracer does not see)."""
    for pos, name, _w, is_list in plan.tensor_args:
        v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
        if isinstance(v, torch.Tensor) and v.is_cpu and v.layout is _STRIDED and v.nbytes:
            p = v.data_ptr()
            if p and not is_pinned(tracer, v, p) and v.is_pinned():
                ev = register_pinned(tracer, v)
                if ev is not None:
                    tracer.buffer.events.append(ev)


def known_pinned_block(tracer, t) -> bool:
    """Whether a pinning op's CPU output is pinned. PyTorch's host allocator hands the same cached blocks out
    again and again, so a block already seen pinned at this address with this size needs no ``is_pinned()``
    query (a call into the CUDA driver, costly per op)."""
    st = t.untyped_storage()
    if tracer.pinned.get(st.data_ptr()) == st.nbytes():
        return True
    return t.is_pinned()


def register_pinned(tracer, t, stack: int = 0) -> tuple | None:
    """A new pinned host block (an op's output): returns its ALLOC event."""
    st = t.untyped_storage()
    base = st.data_ptr()
    size = st.nbytes()
    if size == 0:
        return None
    tracer.pinned[base] = size
    if tracer.staged.kept:
        tracer.staged.forget(((E.PINNED, base, size),))
    return (E.ALLOC, E.PINNED, base, size, E.HOST, stack, tracer.ctx, describe(t))


def staged_write(tracer, evs, t, r, stack, ctx) -> None:
    """Before an asynchronous copy out of pinned memory: the host's writes to it that no traced call showed
    since the block's previous such copy (:mod:`streamsan.tracers.staging`), as a host write."""
    base = r[1] - t.storage_offset() * t.element_size()
    written = tracer.staged.check(r, base, t if t._base is None else t._base, t.element_size())
    if written is not None:
        evs.append(refill_op(written, stack, ctx))
