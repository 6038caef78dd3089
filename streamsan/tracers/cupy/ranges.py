"""The byte ranges CuPy calls touch: of device arrays, of NumPy arrays over pinned memory, of raw pointers.

A range is ``(space, start, nbytes)``, or for a strided layout the form of :func:`..pinned_numpy.strided_range`;
``space`` is a device index or ``PINNED``. Reading a range never synchronizes or reads device memory: it uses
array metadata, the tracer's known pinned blocks and ``cudaPointerGetAttributes``.
"""

from __future__ import annotations

from ... import events as E
from ..pinned_numpy import strided_range


def describe(a) -> str:
    """An array's allocation description in reports (``float32[4, 8]``)."""
    return f"{a.dtype}{list(a.shape)}"


def array_address(arr) -> int:
    """The address of a NumPy array's first element."""
    return arr.__array_interface__["data"][0]


def c_strides(shape, itemsize):
    """The strides of a C-contiguous array of this shape."""
    out = []
    s = itemsize
    for n in reversed(shape):
        out.append(s)
        s *= max(n, 1)
    return tuple(reversed(out))


def device_range(a):
    """The device range of a ``cupy.ndarray`` (None when empty)."""
    if a.size == 0:
        return None
    data = a.data
    if a._c_contiguous or a._f_contiguous:
        return (data.device_id, data.ptr, a.nbytes)
    return strided_range(data.device_id, data.ptr, a.shape, a.strides, a.itemsize)


def host_range(tracer, arr, query=False, known=False):
    """The PINNED range of a NumPy array if its memory is pinned: in a block the tracer knows, or (``query``)
    one that ``is_memory_pinned`` says is, which is then registered and declared as an allocation of the
    array's base. ``known``: the caller found the block already. None for pageable memory and empty arrays."""
    if arr.size == 0:
        return None
    ptr = arr.__array_interface__["data"][0]
    if not known and tracer.pinned_blocks.find(ptr) is None:
        if not query:
            return None
        try:
            from cupy.cuda import pinned_memory

            pinned = pinned_memory.is_memory_pinned(ptr)
        except Exception:
            pinned = False
        if not pinned:
            return None
        base = arr
        while isinstance(getattr(base, "base", None), tracer._numpy.ndarray):
            base = base.base
        bptr = base.__array_interface__["data"][0]
        tracer.pinned_blocks[bptr] = base.nbytes
        tracer._sink().append((E.ALLOC, E.PINNED, bptr, base.nbytes, E.HOST, 0, tracer.ctx,
                               f"pinned {describe(base)}"))
    return strided_range(E.PINNED, ptr, arr.shape, arr.strides, arr.itemsize)


def pointer_space(tracer, ptr: int):
    """The space of a raw pointer: a device index, PINNED, or None (pageable host memory, or unknown)."""
    if tracer.pinned_blocks.find(ptr) is not None:
        return E.PINNED
    try:
        attrs = tracer._rt.pointerGetAttributes(ptr)
    except Exception:
        return None
    t = getattr(attrs, "type", 0)
    if t == 1:
        return E.PINNED
    if t in (2, 3):
        return int(attrs.device)
    return None


def pitched_range(space, ptr, pitch, width, height):
    """The range of a 2D copy's rows (``height`` rows of ``width`` bytes, ``pitch`` apart), or None if empty."""
    if width <= 0 or height <= 0:
        return None
    if height == 1 or pitch == width:
        return (space, ptr, width * height if pitch == width else width)
    return (space, ptr, pitch * (height - 1) + width, (1, (height, width), (pitch, 1)))
