"""Who carries PyTorch's GPU-trace events to streamsan's callbacks: the native observer, or PyTorch's Python path.

PyTorch fires each CUDA trace event (an allocation, a free, an event record, wait or synchronize, a stream or device
synchronize) through the interpreter in its process-wide GPU-trace slot, and the first interpreter registered there
keeps it. PyTorch's own (``torch._C._activate_gpu_trace()``) takes the GIL, imports ``torch.cuda._gpu_trace`` and
walks two attributes per event before it calls the registry's ``fire_callbacks``; the native observer
(``streamsan/native/``), put in the slot first, calls the same registries' ``fire_callbacks`` directly. Either way
the same callbacks run, on the same thread, at the same moment, so what streamsan sees is the same; only the cost
per event differs.

``activate()`` runs once per process: the native carrier where CUDA is there, the observer builds or loads for
this torch, ``STREAMSAN_GPU_TRACE`` is not ``python`` and the slot is free; else PyTorch's, and ``REASON`` says why
(one line, for the report). A later ``torch._C._activate_gpu_trace()`` (CSAN, a profiler) leaves the slot as it is;
their callbacks are in the same registries and are fired too.
"""

from __future__ import annotations

import os

CARRIER: str | None = None  # "native" or "python" once activated
REASON = ""  # why the carrier is PyTorch's Python path


def activate() -> None:
    """Make PyTorch fire its GPU-trace callbacks (once per process)."""
    global CARRIER, REASON
    if CARRIER is not None:
        return
    import torch

    owned, why = _take_slot()
    if owned:
        CARRIER, REASON = "native", ""
        return
    torch._C._activate_gpu_trace()
    CARRIER, REASON = "python", why


def _take_slot() -> tuple[bool, str]:
    import torch

    if os.environ.get("STREAMSAN_GPU_TRACE", "").strip().lower() == "python":
        return False, "STREAMSAN_GPU_TRACE=python"
    try:
        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    if not cuda:
        return False, "no CUDA device"
    from ...native import observer

    owned, why = observer.install_gpu_trace()
    if not owned:
        return False, why
    import torch.cuda._gpu_trace as gpu_trace

    observer.forward_gpu_trace(gpu_trace)
    return True, ""


def quiet(flag: bool) -> None:
    """Whether the native carrier may skip PyTorch's Python callbacks (none of them wants the events: no tracer is
    active, no one else registered one); PyTorch's own path always calls them."""
    if CARRIER == "native":
        from ...native import observer

        observer.quiet_gpu_trace(flag)


def describe() -> str | None:
    """The report's ``environment.gpu_trace``: ``native``, ``python (why)``, or None before any tracing."""
    if CARRIER is None:
        return None
    return CARRIER if not REASON else f"{CARRIER} ({REASON})"
