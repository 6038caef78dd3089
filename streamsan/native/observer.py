"""The native observer's Python API: build or load it, start and stop it, arm threads, drain its records, own
PyTorch's GPU-trace slot.

``load()`` is ``(module, "")`` or ``(None, reason)``, once per process (the tracer runs in Python where it is
None). ``start(frames)`` observes the calling thread from then on (and every thread that inherits its
``ThreadLocalState``, the autograd engine's included); a Python thread started later is observed once it calls
``arm_thread()``: ``thread_start_hook`` does that as a ``threading.setprofile`` hook. ``drain()`` takes what was
recorded since the last drain, packed (decode it with :class:`streamsan.native.records.Decoder`, off the program's
thread if need be). ``install_gpu_trace()`` puts the observer in PyTorch's GPU-trace slot, which the first
interpreter registered keeps for good: false (and the caller keeps PyTorch's Python callbacks) where it is taken.
"""

from __future__ import annotations

import atexit
import sys
import threading

from . import records
from .build import load_extension

DEFAULT_FRAMES = 25  # the innermost frame and 24 outside it: as far as the stack table's key looks
_loaded: tuple | None = None
_lock = threading.Lock()
_exit_hook = False


def load():
    """The extension module and "", or None and the reason it is off."""
    global _loaded
    with _lock:
        if _loaded is None:
            module, reason = load_extension()
            if module is not None and getattr(module, "LAYOUT", None) != records.LAYOUT:
                module, reason = None, (f"the native observer's record layout {getattr(module, 'LAYOUT', '?')} is "
                                        f"not {records.LAYOUT}")
            _loaded = (module, reason)
        return _loaded


def _module():
    module, reason = load()
    if module is None:
        raise RuntimeError(reason)
    return module


def start(frames: int = DEFAULT_FRAMES) -> None:
    """Observe from now on: the calling thread is armed; call sites keep up to ``frames`` Python frames (0: none).
    Dispatch modes already pushed on this thread are below the observed mode; those pushed later are above it
    (their ops are marked ``MODE_ABOVE``)."""
    global _exit_hook
    module = _module()
    if not _exit_hook:  # (no op is observed while the interpreter shuts down)
        atexit.register(module.stop)
        _exit_hook = True
    module.start(frames)


def stop() -> None:
    """Observe no more. Records already made stay to be drained; other threads' registrations go the next time
    they see an op (PyTorch lets a thread-local callback be removed only from its own thread)."""
    _module().stop()


def arm_thread() -> bool:
    """Observe the calling thread too (while started): whether it was not armed yet."""
    return _module().arm_thread()


def thread_start_hook(frame, event, arg):
    """A ``threading.setprofile`` hook: arms each new thread at its first call, then removes itself there."""
    sys.setprofile(None)
    module = _loaded[0] if _loaded else None
    if module is not None:
        module.arm_thread()


def sequence() -> int:
    """The next sequence number (ops and GPU-trace events share the counter)."""
    return _module().sequence()


def drain():
    """What was recorded since the last drain: (records, tensors, dims, events, new ops, new sites)."""
    return _module().drain()


def decoder() -> records.Decoder:
    """A decoder for this observer's drains (knowing every op and call site met so far)."""
    module = _module()
    return records.Decoder(module.scalar_type_names(), module.tables())


def install_gpu_trace() -> tuple[bool, str]:
    """Put the observer in PyTorch's GPU-trace slot: (True, "") where it owns it now, else (False, why)."""
    module, reason = load()
    if module is None:
        return False, reason
    return module.install_gpu_trace()


def owns_gpu_trace() -> bool:
    """Whether PyTorch's GPU-trace slot is the observer's."""
    module, _ = load()
    return module is not None and module.owns_gpu_trace()


def forward_gpu_trace(gpu_trace) -> None:
    """While the observer owns the slot, fire the Python callbacks of ``gpu_trace``'s registries (PyTorch's
    ``torch.cuda._gpu_trace``) for each CUDA event, each registry's ``fire_callbacks`` as it is at that event; None
    stops it. The registries are looked up now, once."""
    _module().forward_gpu_trace(gpu_trace)


def quiet_gpu_trace(quiet: bool) -> None:
    """While ``quiet``, forward no CUDA event to the Python callbacks (the caller knows none of them wants it: no
    tracer is active and no one else registered one); the events are still recorded while started."""
    _module().quiet_gpu_trace(quiet)
