"""Which library versions the tracers support, checked without side effects."""

from __future__ import annotations

MIN_TORCH = (2, 4)
NO_CUDA = "no CUDA device is available: nothing could be checked (the program ran unchanged)"


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_torch(torch_module) -> str | None:
    """None if this torch can be traced, else one line saying why nothing will be checked."""
    version = getattr(torch_module, "__version__", "unknown")
    if _version_tuple(str(version)) < MIN_TORCH:
        return (f"torch {version} is not supported (streamsan needs torch >= {'.'.join(map(str, MIN_TORCH))}): "
                "nothing could be checked (the program ran unchanged)")
    C = getattr(torch_module, "_C", None)
    if C is None or not hasattr(C, "_activate_gpu_trace"):
        return f"torch {version} lacks the GPU trace callbacks streamsan needs: nothing could be checked"
    return None


def check_cupy(cupy_module) -> str | None:
    """None if this CuPy can be traced, else one line saying why nothing will be checked (never raises)."""
    cuda = getattr(cupy_module, "cuda", None)
    if cuda is None or not hasattr(cuda, "MemoryHook") or not hasattr(cupy_module, "ndarray"):
        return (f"cupy {getattr(cupy_module, '__version__', 'unknown')} lacks the APIs streamsan needs: "
                "nothing could be checked")
    try:
        available = bool(cuda.is_available())
    except Exception:
        available = False
    return None if available else NO_CUDA
