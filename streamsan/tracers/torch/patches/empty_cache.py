"""``torch.cuda.empty_cache()``: the caching allocator hands every segment it holds no block of back to the driver
(``cudaFree``, which waits for the whole device; expandable segments are unmapped after their stream), the private
pools of destroyed graphs and memory pools included. The GPU trace reports none of it: the segments the allocator
holds before and after the call (its memory snapshot) tell which bytes went back, and each such range is one
``RELEASE`` event (docs/semantics.md, "Memory handed back to the driver"). Segments still split by a live block
stay, and so do the races on them.
"""

from __future__ import annotations

import torch

from .... import events as E
from ..allocators import allocations_unreported
from .attributes import Replaced


def install(tracer):
    """Patch ``torch.cuda.empty_cache`` (also reached as ``torch.cuda.memory.empty_cache``); returns the undo."""
    replaced = Replaced()
    cuda = getattr(torch, "cuda", None)
    memory = getattr(cuda, "memory", None)
    orig = getattr(cuda, "empty_cache", None)
    if orig is None:
        return replaced.undo

    def empty_cache(*args, **kwargs):
        if not (tracer.tracing and tracer.in_scope) or not torch.cuda.is_initialized() or allocations_unreported(tracer):
            return orig(*args, **kwargs)
        try:
            before = held_segments()
        except Exception as exc:
            tracer.stop_on_bug(exc, "torch.cuda.empty_cache")
            return orig(*args, **kwargs)
        out = orig(*args, **kwargs)
        try:
            gone = released_ranges(before, held_segments())
            if gone:
                stack = tracer.stacks.capture(tracer.buffer.events, 2)
                for space, start, size in gone:
                    tracer.emit((E.RELEASE, space, start, size, stack))
        except Exception as exc:
            tracer.stop_on_bug(exc, "torch.cuda.empty_cache")
        return out

    empty_cache.__wrapped__ = orig
    empty_cache.__doc__ = orig.__doc__
    for mod in (cuda, memory):
        if mod is not None and getattr(mod, "empty_cache", None) is orig:
            replaced.add(mod, "empty_cache", orig)
            mod.empty_cache = empty_cache
    return replaced.undo


def held_segments() -> list[tuple[int, int, int]]:
    """The segments PyTorch's caching allocator holds now, on every device: (device, address, size)."""
    return [(int(s["device"]), int(s["address"]), int(s["total_size"])) for s in torch.cuda.memory_snapshot()]


def released_ranges(before, after) -> list[tuple[int, int, int]]:
    """The byte ranges held before and not after, as (device, start, size) in address order: a whole segment freed,
    or the pages an expandable segment unmapped."""
    same = set(after)
    kept: dict[int, list] = {}
    for dev, start, size in after:
        kept.setdefault(dev, []).append((start, start + size))
    out = []
    for dev, start, size in sorted(before):
        if (dev, start, size) in same:  # (a segment that stayed whole: the common case)
            continue
        pieces = [(start, start + size)]
        for lo, hi in kept.get(dev, ()):
            pieces = [p for a, b in pieces for p in ((a, min(b, lo)), (max(a, hi), b)) if p[0] < p[1]]
        out += [(dev, a, b - a) for a, b in pieces]
    return out
