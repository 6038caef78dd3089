"""The dispatch lane (``streamsan/native/lane.cpp``): the tracer's dispatch mode, entered without PyTorch's Python
dispatch.

:func:`attach` routes a tracer's ops through a C-core ``Dispatch`` made for the lane: from then on the lane sits
right above each of the tracer's ``TracingMode`` entries (the topmost on each thread), takes each op as the
dispatcher's boxed stack and hands it to the C core, or passes it down to the ``TracingMode`` (PyTorch's Python
path, as without the lane) for whatever the core declines. :func:`detach` ends it. The events are the C core's
either way, so the findings are the same as under the ``TracingMode`` alone.

PyTorch's Python functions over the mode stack are wrapped, once for the process, so that Python code never meets
the lane (PyTorch asserts that each mode on the stack is a Python object of its own interpreter): each call takes
the lane off the calling thread's stack and puts it back afterwards.

Off, with the reason (:func:`attach`'s answer, and :func:`reason`), where the C core is off, the allocator
reports no allocations (the Python tracer runs), the native observer is not built for this torch, or
``STREAMSAN_CORE`` is ``c`` or ``python``.
"""

from __future__ import annotations

import functools
import os

import torch

from ...native import observer
from . import ccore
from .allocators import ALLOCATOR

# PyTorch's mode-stack functions (``torch._C``'s, and the names ``torch.utils._python_dispatch`` imported)
MODE_STACK_FUNCTIONS = ("_len_torch_dispatch_stack", "_get_dispatch_stack_at", "_pop_torch_dispatch_stack",
                        "_push_on_torch_dispatch_stack")

NOT_STARTED = "no torch tracer started"
CORE_OFF = "the C core is off"
_wrapped = False
_last_reason = NOT_STARTED
_attached = None  # the tracer whose ops the lane routes


def attach(tracer, mode_type) -> str:
    """Route ``tracer``'s ops through the lane (``mode_type``: its ``TracingMode`` class): "" when it is on,
    else why not."""
    global _last_reason, _attached
    _last_reason = _attach(tracer, mode_type)
    if not _last_reason:
        _attached = tracer
    return _last_reason


def _attach(tracer, mode_type) -> str:
    core = os.environ.get("STREAMSAN_CORE", "").strip().lower()
    if core in ("c", "python"):
        return f"STREAMSAN_CORE={core}"
    ctracer = ccore.configured()
    if ctracer is None:
        return CORE_OFF
    if ALLOCATOR.unreported:
        return "the allocator reports no allocations"
    module, reason = observer.load()
    if module is None:
        return reason
    if not getattr(module, "LANE", 0):
        return "this torch's PyInterpreterVTable has methods the lane does not know"
    dispatch = ctracer.Dispatch(tracer, module.lane_declined, tracer, module.lane_runner)
    _wrap_mode_stack(module)
    if detach not in ALLOCATOR.leave_c_core:
        ALLOCATOR.leave_c_core.append(detach)
    module.lane_install(dispatch, mode_type)
    return ""


def detach(tracer=None) -> None:
    """No more lane (for ``tracer``'s ops, or whoever's): this thread's entry goes now, other threads' entries pass
    ops down until Python code looks at their stack."""
    global _attached, _last_reason
    if _attached is None or (tracer is not None and tracer is not _attached):
        return
    _attached = None
    module, _ = observer.load()
    if module is not None and getattr(module, "LANE", 0):
        module.lane_uninstall()
    if tracer is None:
        _last_reason = "the allocator reports no allocations"


def reason() -> str:
    """Why the lane was off for the last tracer started ("" if it was on, :data:`NOT_STARTED` before any)."""
    return _last_reason


def handled() -> tuple[int, int]:
    """Ops the lane handed to the C core and ops it passed down, in this process so far."""
    module, _ = observer.load()
    if module is None or not getattr(module, "LANE", 0):
        return (0, 0)
    return module.lane_counts()


def _wrap_mode_stack(module) -> None:
    global _wrapped
    if _wrapped:
        return
    from torch.utils import _python_dispatch

    for name in MODE_STACK_FUNCTIONS:
        original = getattr(torch._C, name, None)
        if original is None:
            continue
        wrapper = _hiding_the_lane(original, module, name == "_push_on_torch_dispatch_stack")
        setattr(torch._C, name, wrapper)
        if getattr(_python_dispatch, name, None) is original:
            setattr(_python_dispatch, name, wrapper)
    _wrapped = True


def _hiding_the_lane(original, module, pushes: bool):
    """``original`` called with the lane off the calling thread's mode stack; put back afterwards (after a push
    too: a ``TracingMode`` pushed gets the lane above it)."""
    hide, reconcile = module.lane_hide, module.lane_reconcile

    @functools.wraps(original)
    def call(*args, **kwargs):
        hidden = hide()
        try:
            return original(*args, **kwargs)
        finally:
            if hidden or pushes:
                reconcile()

    return call
