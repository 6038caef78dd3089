"""Tensor helpers of the torch tracer: byte ranges, storage bases, subclass kinds, output blocks, descriptions.

A range is what :mod:`streamsan.events` names memory by: ``(space, start, size)``, with a strided layout added
where the tensor's elements do not cover their extent densely. Device tensors are the ones :mod:`.device` says.
"""

from __future__ import annotations

import torch

from ... import events as E
from . import device

_STRIDED = torch.strided

DESCRIPTIONS: dict = {}  # (dtype, shape) -> describe()'s text (the C core reads it too)


def describe(t) -> str:
    """``dtype[shape]`` of a tensor, e.g. ``bfloat16[1, 8, 512, 128]``."""
    key = (t.dtype, t.shape)
    d = DESCRIPTIONS.get(key)
    if d is None:
        if len(DESCRIPTIONS) > 4096:
            DESCRIPTIONS.clear()
        d = DESCRIPTIONS[key] = f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
    return d


_NO_MEMORY = ("FakeTensor", "FunctionalTensor")
PLAIN, MEMORYLESS, WRAPPER = 0, 1, 2
_subclass_kinds: dict = {}


def subclass_kind(types) -> int:
    """What the tensor subclasses of an op are: fake tensors of tracing compilers and functionalization wrappers
    stand for no real memory (such ops are not accesses); wrapper subclasses (DTensor, ...: they declare their
    inner tensors with ``__tensor_flatten__``) run the op on inner tensors the dispatch mode does not see;
    anything else is memory of its own."""
    kind = PLAIN
    for ty in types:
        k = _subclass_kinds.get(ty)
        if k is None:
            k = _subclass_kinds[ty] = MEMORYLESS if any(c.__name__ in _NO_MEMORY for c in ty.__mro__) else \
                WRAPPER if hasattr(ty, "__tensor_flatten__") else PLAIN
        if k == MEMORYLESS:
            return k
        kind = kind or k
    return kind


def plain_tensors(obj):
    """The tensors with memory of their own in an op argument or result: wrapper subclasses are replaced by their
    inner tensors, recursively; lists and tuples are walked."""
    if isinstance(obj, torch.Tensor):
        if hasattr(type(obj), "__tensor_flatten__"):
            for name in obj.__tensor_flatten__()[0]:
                yield from plain_tensors(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from plain_tensors(x)


def device_among(values) -> int:
    """The device of the first device tensor among an op's argument values (lists walked), or -1."""
    return next((t.get_device() + device.OFFSET for v in values for t in plain_tensors(v)
                 if getattr(t, device.ATTR)), -1)


def device_of_output(out) -> int:
    """The device of an op's first device output tensor, or -1."""
    if isinstance(out, torch.Tensor):
        return out.get_device() + device.OFFSET if getattr(out, device.ATTR) else -1
    if isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, torch.Tensor) and getattr(t, device.ATTR):
                return t.get_device() + device.OFFSET
    return -1


def cuda_target(kwargs) -> int:
    """The CUDA device index an op's ``device`` argument names (the current device for ``cuda``), or -1."""
    d = kwargs.get("device")
    if d is None:
        return -1
    if not isinstance(d, torch.device):
        try:
            d = torch.device(d)
        except (RuntimeError, TypeError):
            return -1
    if d.type != "cuda":
        return -1
    return d.index if d.index is not None else device.current()


def tensors_in(obj, limit: int = 100_000):
    """The tensors in a nest of dicts, lists, tuples and sets (a state dict, a checkpoint), at most ``limit``
    containers and tensors visited."""
    todo = [obj]
    while todo and limit > 0:
        limit -= 1
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo.extend(x)


def storage_base(t) -> int:
    return t.untyped_storage().data_ptr()


def output_blocks(out, storages=None) -> dict:
    """storage pointer -> (bytes, description) of an op's device outputs (``storages``, a dict: filled with
    storage pointer -> the storage)."""
    sizes = {}
    if out is not None:
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and getattr(t, device.ATTR):
                try:
                    st = t.untyped_storage()
                    ptr = st.data_ptr()
                    sizes[ptr] = (st.nbytes(), describe(t))
                except RuntimeError:  # sparse, or a subclass without storage: no single block
                    continue
                if storages is not None:
                    storages[ptr] = st
    return sizes


def range_of(tracer, t):
    """The byte range a tensor's kernel may touch, or None (not device / pinned memory, or empty)."""
    if getattr(t, device.ATTR):
        return range_in(tracer, t, t.get_device() + device.OFFSET)
    if t.is_cpu:
        return range_in(tracer, t, E.PINNED)
    return None


def range_in(tracer, t, space: int):
    """The byte range of tensor ``t`` in ``space`` (a device, or PINNED for a block ``tracer`` knows pinned), or
    None (empty, not pinned, or a layout without one: noted once)."""
    try:
        n = t.nbytes
        if n == 0:
            return None
        p = t.data_ptr()
    except RuntimeError:  # sparse and other layouts, tensors without storage
        what = f"{t.layout} tensors" if t.layout is not _STRIDED else "tensors without storage"
        tracer.note_once(f"layout:{what}", f"{what} are not analyzed (streamsan follows strided memory only)")
        return None
    if space == E.PINNED:
        if not is_pinned(tracer, t, p):
            return None
    if t.is_contiguous():
        return (space, p, n)
    sizes = t.shape
    strides = t.stride()
    its = t.element_size()
    extent = 1
    dense = True
    for sz, st in zip(sizes, strides):
        if sz > 1:
            if st == 0:
                dense = False
            extent += (sz - 1) * st
    extent *= its
    if dense and extent == n:
        return (space, p, n)
    return (space, p, extent, (its, tuple(sizes), tuple(strides)))


def is_pinned(tracer, t, p) -> bool:
    """Whether the tensor ``t`` at data pointer ``p`` lies in a pinned block ``tracer`` knows (by its storage's
    base)."""
    pinned = tracer.pinned
    if not pinned:
        return False
    base = p - t.storage_offset() * t.element_size()
    return base in pinned


def output_ranges(tracer, out, writes) -> None:
    """Append the ranges of an op's output tensors to ``writes``."""
    if isinstance(out, torch.Tensor):
        r = range_of(tracer, out)
        if r is not None:
            writes.append(r)
    elif isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, torch.Tensor):
                r = range_of(tracer, t)
                if r is not None:
                    writes.append(r)


def args_ranges(tracer, plan, args, kwargs):
    """(reads, writes): the ranges of the tensor arguments an op's plan names."""
    reads, writes = [], []
    for pos, name, is_write, is_list in plan.tensor_args:
        v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
        for t in (v if is_list else (v,)):
            if isinstance(t, torch.Tensor):
                r = range_of(tracer, t)
                if r is not None:
                    (writes if is_write else reads).append(r)
    return reads, writes
