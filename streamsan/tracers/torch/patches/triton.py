"""Triton, once the program imports it: each launch of a ``@triton.jit`` kernel (``JITFunction.run``) is an op on the
stream it runs on; its device tensors (or tensor descriptors' base tensors), and the allocations its integer
arguments point into, are written if its stores reach them (:mod:`streamsan.tracers.triton`), else read.
"""

from __future__ import annotations

import itertools

import torch

from .... import events as E
from ...triton import kernel_writes
from .. import device
from ..cuda_graphs import captured
from ..tensors import range_in
from .attributes import Replaced

_STRIDED = torch.strided


def install(tracer, triton_module, memory):
    """Patch ``JITFunction.run`` of ``triton_module`` (``memory``: the session's
    :class:`streamsan.tracers.addresses.LiveMemory`); returns the undo."""
    replaced = Replaced()
    jit = getattr(getattr(triton_module, "runtime", None), "jit", None)
    cls = getattr(jit, "JITFunction", None)
    orig = cls.__dict__.get("run") if cls is not None else None
    if orig is None:
        return replaced.undo

    def run(kernel, *args, **kwargs):
        out = orig(kernel, *args, **kwargs)
        if not kwargs.get("warmup") and (tracer.tracing and tracer.in_scope or tracer.graphs.current is not None):
            try:
                launched(tracer, kernel, args, kwargs, memory)
            except Exception as exc:
                tracer.stop_on_bug(exc, f"triton:{getattr(kernel, '__name__', 'kernel')}")
        return out

    run.__wrapped__ = orig
    cls.run = run
    replaced.add(cls, "run", orig)
    return replaced.undo


def launched(tracer, kernel, args, kwargs, memory) -> None:
    """A Triton kernel launched with these arguments: an op on the current stream, or a node of the graph being
    captured. An integer argument that points into a live allocation the session knows
    (:mod:`streamsan.tracers.addresses`) accesses it from there to its end, as a pointer argument would; a launch
    that reaches pinned memory so is ``OP_UNRECORDED`` (PyTorch's pinned allocator records no event for it)."""
    written = kernel_writes(kernel)
    reads, writes = [], []
    dev = -1
    flags = 0
    pointed = memory.pointed_range
    for name, v in itertools.chain(zip(kernel.arg_names, args), kwargs.items()):
        t = v if isinstance(v, torch.Tensor) else getattr(v, "base", None)
        if not isinstance(t, torch.Tensor):
            r = pointed(v)
            if r is None:
                continue
            if r[0] >= 0:
                dev = r[0]
            else:
                flags = E.OP_UNRECORDED
        elif not getattr(t, device.ATTR) or t.layout is not _STRIDED:
            continue
        else:
            r = range_in(tracer, t, t.get_device() + device.OFFSET)
            if r is None:
                continue
            dev = t.get_device() + device.OFFSET
        (writes if written is None or name in written else reads).append(r)
    if dev < 0:
        if not flags:
            return
        dev = device.current()  # (only pinned memory, through integers: the kernel runs on the current device)
    if written is None:
        tracer.note_once("triton-source", "Triton kernels whose source streamsan cannot read count as writing "
                                          "every tensor argument")
    cap = tracer.graphs.current
    if not tracer.tracing:
        if cap is not None:
            captured(tracer, cap, dev, f"triton:{kernel.__name__}", reads, writes)
        return
    tracer.saw_cuda = True
    tracer.index_values.written(writes)
    tracer.emit((E.OP, tracer.agent(dev, device.raw_stream(dev)), f"triton:{kernel.__name__}", tuple(reads),
                 tuple(writes), tracer.stacks.capture(tracer.buffer.events, 2), tracer.ctx, flags))
