"""Patch: CuPy's memory pool, through a ``cupy.cuda.MemoryHook`` (pool mallocs with their pointer and rounded size,
and frees). The owner of a block is the stream current at malloc: the arena CuPy's ``MemoryPool`` files it under,
whose later allocations may reuse it once freed (CuPy has no ``record_stream``).

Memory hooks are per thread: the hook is entered in the thread that starts the tracer and, through a threading
profile function, in each thread started after; threads started before are not hooked.
"""

from __future__ import annotations

import sys
import threading

from ..patching import Patches


def install(tracer):
    patches = Patches(tracer, "memory")
    with patches:
        hooks: list = []  # one per hooked thread
        prev = _threading_getprofile()

        def thread_start(frame, event, arg):
            sys.setprofile(None)
            if tracer.running:
                try:
                    _enter_hook_here(tracer, hooks)
                except Exception:
                    pass
            if prev is not None:
                prev(frame, event, arg)

        patches.on_undo(lambda: threading.setprofile(prev) if _threading_getprofile() is thread_start else None)
        patches.on_undo(lambda: _leave(hooks))
        _enter_hook_here(tracer, hooks)
        threading.setprofile(thread_start)
    return patches.undo


def _enter_hook_here(tracer, hooks: list) -> None:
    hook = _make_hook(tracer.cp, tracer)
    hook.__enter__()
    hooks.append(hook)


def _leave(hooks: list) -> None:
    for hook in hooks:
        try:
            hook.__exit__(None, None, None)
        except Exception:
            pass
    hooks.clear()


def _make_hook(cp, tracer):
    class _Hook(cp.cuda.MemoryHook):
        name = "streamsan"

        def malloc_postprocess(self, **kw):
            tracer._on_malloc(kw.get("device_id", 0), kw.get("mem_ptr", 0), kw.get("mem_size", 0))

        def free_preprocess(self, **kw):
            tracer._on_free(kw.get("device_id", 0), kw.get("mem_ptr", 0))

    return _Hook()


def _threading_getprofile():
    get = getattr(threading, "getprofile", None)
    return get() if get is not None else getattr(threading, "_profile_hook", None)
