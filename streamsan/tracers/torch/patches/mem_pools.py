"""``torch.cuda.use_mem_pool(pool)``: the calling thread's allocations inside go to a private pool, and their blocks
go back to it when freed, for allocations routed there only: the ALLOC events made meanwhile carry the pool (a
small number per pool), so that the analyzer knows which allocations can reuse them.
"""

from __future__ import annotations

import torch

from ..allocators import RoutedToPool
from .attributes import Replaced


def install(tracer):
    """Patch ``use_mem_pool`` where torch has it; returns the undo."""
    replaced = Replaced()
    cuda = getattr(torch, "cuda", None)
    memory = getattr(cuda, "memory", None)
    orig = getattr(memory, "use_mem_pool", None)
    if orig is None:
        return replaced.undo
    routing = tracer.pool_of_thread
    numbers: dict = {}

    def use_mem_pool(pool, *args, **kwargs):
        cm = orig(pool, *args, **kwargs)
        try:
            number = numbers.setdefault(pool.id, len(numbers) + 1)
        except Exception:  # not a MemPool: the original raises, or routes nowhere streamsan can name
            return cm
        return RoutedToPool(cm, routing, number)
    use_mem_pool.__wrapped__ = orig
    use_mem_pool.__doc__ = orig.__doc__
    for mod in (memory, cuda):
        if getattr(mod, "use_mem_pool", None) is orig:
            replaced.add(mod, "use_mem_pool", orig)
            mod.use_mem_pool = use_mem_pool
    return replaced.undo
