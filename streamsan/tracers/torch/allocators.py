"""PyTorch's CUDA allocator backends as the torch tracer sees them (:class:`AllocatorBackend`: whether the GPU trace
reports allocations and frees, and the frees of the blocks it does not report), and ``use_mem_pool``'s private
pools (:class:`RoutedToPool`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from ... import events as E
from .tensors import output_blocks

_get_ident = threading.get_ident

# PyTorch's CUDA allocators that report nothing to its GPU trace: the cudaMallocAsync backend, and an allocator
# of the program's own (``torch.cuda.memory.change_current_allocator``, e.g. RMM's), which allocates on the current
# stream and frees on the stream it allocated on.
UNREPORTING_BACKENDS = ("cudaMallocAsync", "pluggable")


class AllocatorBackend:
    """Whether PyTorch's CUDA allocator reports its allocations and frees to the GPU trace (the native caching
    allocator does; ``UNREPORTING_BACKENDS`` do not). Known once CUDA is initialized (asking earlier would read
    ``PYTORCH_CUDA_ALLOC_CONF`` before the program sets it, and a program's own allocator must be in place by
    then), the same for the whole process; ``name`` is the backend's.

    Where it does not, the tracer declares each op's new CUDA outputs itself (ALLOC in ``E.UNREPORTED_POOL``), so
    only the Python tracer runs: every dispatch mode made so far (``modes``) leaves the C one, and each function of
    ``leave_c_core`` is called (the dispatch lane's detach); and it learns their frees from their storages
    (:meth:`watch`)."""

    __slots__ = ("unreported", "name", "modes", "leave_c_core", "watched", "deaths_seen")

    def __init__(self):
        self.unreported: bool | None = None  # None: not known yet
        self.name = ""
        self.modes = weakref.WeakSet()
        self.leave_c_core: list = []
        self.watched: dict[int, tuple] = {}  # base pointer -> (tracer, weak reference to the storage there)
        self.deaths_seen: bool | None = None  # whether a storage's death can be watched (learnt at the first watch)

    def watch(self, tracer, dev: int, base: int, storage) -> None:
        """The free of a block the allocator does not report, for ``tracer``: when its storage dies (PyTorch keeps a
        storage's Python object alive as long as the storage itself, so a weak reference to it dies with the last
        tensor on it), or when the storage is resized (:meth:`resized`). PyTorch frees a block on the stream it was
        allocated on, after the streams recorded on it: the free the analyzer's missing-record-stream rule
        expects. Not where PyTorch lets a storage's Python object die before the storage (then no free is seen)."""
        if self.deaths_seen is None:
            self.deaths_seen = storage_objects_live_with_their_storage()
        if not self.deaths_seen:
            return
        watched = self.watched

        def freed(ref):
            if watched.get(base, (None, None))[1] is ref:
                del watched[base]
                if tracer.tracing:
                    tracer.emit((E.FREE, dev, base, 0))

        watched[base] = (tracer, weakref.ref(storage, freed))

    def resized(self, tracer, base: int) -> bool:
        """A watched storage of ``tracer`` left its block at ``base`` (a resize): whether it was watched there."""
        w = self.watched.get(base)
        if w is None or w[0] is not tracer:
            return False
        del self.watched[base]
        return True

    def forget(self, tracer) -> None:
        """A stopped tracer's blocks are watched no more."""
        for base in [b for b, w in self.watched.items() if w[0] is tracer]:
            del self.watched[base]

    def learn(self) -> bool | None:
        if self.unreported is None:
            try:
                if not torch.cuda.is_initialized():
                    return None
                self.name = torch.cuda.get_allocator_backend()
                self.unreported = self.name in UNREPORTING_BACKENDS
            except Exception:  # a torch without the query: its only allocator is the native one
                self.unreported = False
            if self.unreported:
                for mode in list(self.modes):
                    mode.__dict__.pop("__torch_dispatch__", None)  # (PyTorch looks it up at every op)
                for leave in self.leave_c_core:
                    leave()
        return self.unreported


def storage_objects_live_with_their_storage() -> bool:
    """Whether a storage's Python object stays alive while a tensor holds the storage (PyTorch's PyObject
    preservation for storages), so that a weak reference to it dies with the storage."""
    t = torch.empty(1)
    ref = weakref.ref(t.untyped_storage())
    alive = ref() is not None
    del t
    return alive and ref() is None


ALLOCATOR = AllocatorBackend()
UNREPORTED_NOTE = ("PyTorch's {} CUDA allocator reports no allocations or frees: streamsan takes each op's new "
                   "outputs as memory allocated on the op's stream, freed when their storage dies, and runs its "
                   "Python tracer")


class RoutedToPool(contextlib.ContextDecorator):
    """``use_mem_pool``'s context manager, telling the tracer (``routing``: thread -> pool number) while the calling
    thread's allocations go to the pool; a decorator too, as the original is."""

    def __init__(self, cm, routing: dict, number: int):
        self.cm = cm
        self.routing = routing
        self.number = number
        self.prev = None

    def _recreate_cm(self):
        recreate = getattr(self.cm, "_recreate_cm", None)
        return RoutedToPool(recreate(), self.routing, self.number) if recreate is not None else self

    def __enter__(self):
        out = self.cm.__enter__()
        tid = _get_ident()
        self.prev = self.routing.get(tid)
        self.routing[tid] = self.number
        return out

    def __exit__(self, *exc):
        tid = _get_ident()
        if self.prev is None:
            self.routing.pop(tid, None)
        else:
            self.routing[tid] = self.prev
        return self.cm.__exit__(*exc)


def allocations_unreported(tracer) -> bool:
    """Whether the allocator reports no allocations (:class:`AllocatorBackend`), learnt once CUDA is up."""
    if ALLOCATOR.unreported is None and ALLOCATOR.learn():
        tracer.note_once("unreported-allocs", UNREPORTED_NOTE.format(ALLOCATOR.name))
    return bool(ALLOCATOR.unreported)


def declare_outputs(tracer, evs, mark, out, dev, agent, stack, ctx) -> None:
    """Where the allocator reports no allocations: an op's new CUDA outputs, as allocations on its stream placed
    before it (``E.UNREPORTED_POOL``), each freed when its storage dies (:meth:`AllocatorBackend.watch`)."""
    storages = {}
    blocks = output_blocks(out, storages)
    evs[mark:mark] = [(E.ALLOC, dev, base, size, agent, stack, ctx, what, E.UNREPORTED_POOL)
                      for base, (size, what) in blocks.items() if size]
    for base, (size, _what) in blocks.items():
        if size:
            ALLOCATOR.watch(tracer, dev, base, storages[base])
