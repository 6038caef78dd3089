"""streamsan: a run-time CUDA stream race detector for PyTorch and CuPy programs.

    with streamsan.watch() as s:
        run_my_gpu_code()
    print(s.findings)

``streamsan wrap -- python script.py`` does the same for an unchanged program (see the README).
"""

from __future__ import annotations

__version__ = "0.1.0"

from .session import Session, current, disable, enable, watch  # noqa: E402


def name_stream(stream, name: str) -> None:
    """Give a stream a role name (e.g. ``"prefetch_stream"``) used in reports of the active session."""
    s = current()
    t = s.tracers.get("torch") if s is not None else None
    if t is not None:
        t.name_stream(stream, name)


def label(tensor, text: str) -> None:
    """Name a tensor's memory (e.g. ``"cache.layers[3].keys"``) in reports of the active session."""
    s = current()
    t = s.tracers.get("torch") if s is not None else None
    if t is not None:
        t.label(tensor, text)


__all__ = ["Session", "watch", "enable", "disable", "current", "name_stream", "label", "__version__"]
