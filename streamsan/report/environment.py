"""Where a program ran: the ``environment`` of a report.

:func:`collect_environment` never fails and needs no GPU. It imports torch only when it is importable (never
at streamsan import time), reports CuPy and transformers only when the program already imported them, and asks
NVML (``pynvml`` from nvidia-ml-py, when installed) for the driver version and GPU names.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys

from .build import version


def _module_version(name: str, import_if_available: bool) -> str | None:
    mod = sys.modules.get(name)
    try:
        if mod is None and import_if_available and importlib.util.find_spec(name) is not None:
            mod = importlib.import_module(name)
        return str(mod.__version__) if mod is not None else None
    except Exception:  # a broken install must not break the report
        return None


def _torch_cuda() -> str | None:
    try:
        return sys.modules["torch"].version.cuda if "torch" in sys.modules else None
    except Exception:
        return None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)  # older pynvml returns bytes


def _nvml() -> tuple[str | None, list[str]]:
    """(driver version, GPU names) from NVML, or (None, []) without NVML or a driver."""
    try:
        import pynvml
    except Exception:
        return None, []
    try:
        pynvml.nvmlInit()
    except Exception:
        return None, []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
        return _text(driver), [_text(n) for n in names]
    except Exception:
        return None, []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def tracer_core() -> str:
    """Which torch tracer runs: ``native`` (the C core, entered through the native dispatch lane), ``c`` (its
    common case in ``streamsan/_ctracer.c``, entered through PyTorch's Python dispatch; and why not the lane, where
    the last tracer started without it), or ``python`` and why."""
    if os.environ.get("STREAMSAN_CORE", "").strip().lower() == "python":
        return "python (STREAMSAN_CORE=python)"
    allocator = getattr(sys.modules.get("streamsan.tracers.torch.allocators"), "ALLOCATOR", None)
    if allocator is not None and allocator.unreported:
        return f"python (PyTorch's {allocator.name} CUDA allocator: the tracer declares allocations)"
    try:
        from .. import _ctracer
    except ImportError:
        return "python (the C tracer was not built: no C compiler at install)"
    if not getattr(_ctracer, "AVAILABLE", 0):
        return "python (the C tracer needs Python 3.11 or later)"
    lane = sys.modules.get("streamsan.tracers.torch.lane")
    if lane is None or lane.reason() in (lane.NOT_STARTED, lane.CORE_OFF):  # (no CUDA: nothing for either)
        return "c"
    return "native" if not lane.reason() else f"c (the dispatch lane is off: {lane.reason()})"


def gpu_trace_carrier() -> str | None:
    """Who carried PyTorch's GPU-trace events in this process (``native``, or ``python`` and why), or None where
    no torch tracer started."""
    slot = sys.modules.get("streamsan.tracers.torch.trace_slot")
    return slot.describe() if slot is not None else None


def collect_environment(import_missing: bool = True) -> dict:
    """streamsan, Python, platform, torch (+ its CUDA runtime), the torch tracer (:func:`tracer_core`), CuPy,
    transformers, NVIDIA driver and GPUs (the command line is the report's own ``command``). Unknown values are
    None. ``import_missing=False``: report torch only if the process imported it (a traced process at exit must
    not import what it never used)."""
    driver, gpus = _nvml()
    torch_version = _module_version("torch", import_if_available=import_missing)
    return {
        "streamsan": version(),
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "torch": torch_version,
        "cuda_runtime": _torch_cuda() if torch_version else None,
        "tracer": tracer_core(),
        "gpu_trace": gpu_trace_carrier(),
        "cupy": _module_version("cupy", import_if_available=False),
        "transformers": _module_version("transformers", import_if_available=False),
        "nvidia_driver": driver,
        "gpus": gpus,
    }


def environment_rows(report: dict) -> list[tuple[str, str]]:
    """(key, text) rows of a report's environment for renderers: lists joined, the command line included, an
    entry that differs between merged processes listing their values; unknown values are ''."""
    env = dict(report.get("environment", {}))
    env.setdefault("command", report.get("command", []))
    varying: dict[str, list] = {}
    for p in report.get("processes", []):
        for k, v in p.get("environment", {}).items():
            varying.setdefault(k, []).append(v)
        if not env["command"] and p.get("command"):
            varying.setdefault("command", []).append(p["command"])
    for k, values in varying.items():
        env[k] = "varies by process: " + "; ".join(dict.fromkeys(_text_of(k, v) or "unknown" for v in values))
    return [(k, _text_of(k, v)) for k, v in env.items()]


def _text_of(key: str, value) -> str:
    if isinstance(value, list):
        value = " ".join(map(str, value)) if key == "command" else ", ".join(map(str, value))
    return "" if value in (None, "") else str(value)
