"""streamsan: a run-time CUDA stream race detector for PyTorch and CuPy programs.

    with streamsan.watch() as s:
        run_my_gpu_code()
    print(s.findings)

``streamsan wrap -- python script.py`` does the same for an unchanged program (see the README).
"""

from __future__ import annotations

__version__ = "0.1.0"

from .session import Session, current, disable, enable, watch  # noqa: E402


def _tracer_for(obj):
    """The active session's tracer that owns ``obj`` (a CuPy or torch stream / array), or None."""
    s = current()
    if s is None:
        return None
    t = s.tracers.get("cupy")
    if t is not None and t.owns(obj):
        return t
    return s.tracers.get("torch")


def name_stream(stream, name: str) -> None:
    """Give a stream (torch or CuPy) a role name (e.g. ``"prefetch_stream"``) used in reports of the active
    session."""
    t = _tracer_for(stream)
    if t is not None:
        t.name_stream(stream, name)


def label(tensor, text: str) -> None:
    """Name a tensor's / array's memory (e.g. ``"cache.layers[3].keys"``) in reports of the active session."""
    t = _tracer_for(tensor)
    if t is not None:
        t.label(tensor, text)


def cupy_access(kernel, reads=(), writes=(), ignore=(), *, name=None):
    """Declare which arguments of a CuPy raw kernel it reads and writes (see ``docs/cupy.md``); returns
    ``kernel``. Without it every array argument of a ``RawKernel`` launch counts as read-and-write."""
    from .tracers.cupy.annotations import cupy_access as declare

    return declare(kernel, reads, writes, ignore, name=name)


def observe(value, name: str) -> None:
    """Name a tensor's / array's values for ``streamsan confirm`` to compare between its runs (e.g. the logits);
    does nothing outside a run of ``streamsan confirm``."""
    from .confirm.runtime import observe as keep

    keep(value, name)


__all__ = ["Session", "watch", "enable", "disable", "current", "name_stream", "label", "cupy_access", "observe",
           "__version__"]
