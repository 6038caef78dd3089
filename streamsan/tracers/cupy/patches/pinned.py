"""Patch: pinned host memory. ``cupy.cuda.alloc_pinned_memory`` declares each block it returns; the
``cupyx.*_pinned`` array functions (patched when ``cupyx`` is imported) return a :mod:`...pinned_numpy` view of
their array, whose host accesses are traced. Other pinned buffers are recognised by ``is_memory_pinned`` when a
copy uses them (:func:`..ranges.host_range`)."""

from __future__ import annotations

import functools
import sys

from ...pinned_numpy import pinned_class
from .. import active
from ..patching import Patches

_PINNED_ARRAYS = ("empty_pinned", "zeros_pinned", "empty_like_pinned", "zeros_like_pinned")


def install(tracer):
    patches = Patches(tracer, "pinned")
    with patches:
        cp = tracer.cp
        orig = cp.cuda.alloc_pinned_memory

        @functools.wraps(orig)
        def alloc_pinned_memory(size):
            mem = orig(size)
            tr = active.tracer
            if tr is not None:
                tr._on_pinned(int(mem.ptr), int(size))
            return mem

        patches.replace(cp.cuda, "alloc_pinned_memory", alloc_pinned_memory)
        pm = getattr(cp.cuda, "pinned_memory", None)
        if pm is not None and getattr(pm, "alloc_pinned_memory", None) is orig:
            patches.replace(pm, "alloc_pinned_memory", alloc_pinned_memory)

    def patch_cupyx(cupyx):
        with patches:
            pa = sys.modules.get("cupyx._pinned_array")
            for name in _PINNED_ARRAYS:
                for mod in (cupyx, pa):
                    f = getattr(mod, name, None) if mod is not None else None
                    if f is None or getattr(f, "_streamsan_traced", False):
                        continue
                    patches.replace(mod, name, _pinned_factory(f))

    tracer.on_import("cupyx", patch_cupyx)
    return patches.undo


def _pinned_factory(orig):
    @functools.wraps(orig)
    def make(*args, **kwargs):
        out = orig(*args, **kwargs)
        if active.tracer is not None:
            cls = pinned_class()
            if not isinstance(out, cls):
                out = out.view(cls)
        return out

    make._streamsan_traced = True
    return make
