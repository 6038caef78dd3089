"""What a traced CuPy call read and wrote, worked out from its arguments and its result.

An analysis is ``analyze(tracer, args, kwargs, out, pre)``, called once the call returned ``out``. It returns
``(reads, writes, flags, fresh)`` (ranges; ``OP_BLOCKING`` when the host waited for the call; ``fresh``: the
descriptions of newly allocated results by pointer, or None), or None when the call accessed no memory (it made
views, or read metadata). Events it appends to ``pre`` (an inferred host access, the synchronization of a
producer's stream) are placed just before the call's op. The rules are in docs/cupy.md.
"""

from __future__ import annotations

import sys

from ... import events as E
from ..pinned_numpy import basic_index, strided_range
from .annotations import ACCESSES
from .ranges import c_strides, describe, device_range, host_range

_OUT_NAMES = ("out", "output")


def arg(args, kwargs, pos, name, default=None):
    """A call's argument by position, else by keyword."""
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def generic(inplace=()):
    """The analysis of most calls: :func:`generic_accesses` with the in-place targets at positions ``inplace``."""
    inplace = tuple(inplace)
    return lambda t, args, kwargs, out, pre: generic_accesses(t, args, kwargs, out, inplace)


def generic_accesses(t, args, kwargs, out, inplace=()):
    """Array arguments read, in-place targets and ``out=`` written, new result arrays written; None for a
    call that only made views of its arguments."""
    if out is NotImplemented:
        return None
    nd = t._ndarray
    np_nd = t._numpy.ndarray
    written = set()
    for pos in inplace:
        v = args[pos] if pos < len(args) else None
        if isinstance(v, nd):
            written.add(id(v))
    for k in _OUT_NAMES:
        o = kwargs.get(k)
        if o is not None:
            for v in (o if isinstance(o, (tuple, list)) else (o,)):
                if isinstance(v, nd):
                    written.add(id(v))
    arrays = []
    hosts = []
    for v in (*args, *kwargs.values()):
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, nd):
                arrays.append(x)
            elif isinstance(x, np_nd):
                hosts.append(x)
    mems = {id(a.data.mem) for a in arrays}
    results = [out] if isinstance(out, nd) else (
        [x for x in out if isinstance(x, nd)] if isinstance(out, (tuple, list)) else [])
    fresh_arrays = [r for r in results if id(r.data.mem) not in mems
                    and type(r.data.mem).__name__ not in ("UnownedMemory", "DLPackMemory")]
    if results and not fresh_arrays and not written:
        return None  # views of the arguments: metadata only
    rng = device_range
    reads, writes = [], []
    for a in arrays:
        r = rng(a)
        if r is not None:
            (writes if id(a) in written else reads).append(r)
    for h in hosts:
        r = host_range(t, h)
        if r is not None:
            reads.append(r)
    fresh = {}
    for a in fresh_arrays:
        r = rng(a)
        if r is not None:
            writes.append(r)
            fresh[a.data.mem.ptr] = describe(a)
    return reads, writes, 0, fresh


def setitem(t, args, kwargs, out, pre):
    """``a[key] = value``: a basic index writes exactly the indexed view, an advanced one the whole array (and
    reads its index arrays); the value is read."""
    a, key, value = args[0], args[1], args[2]
    nd = t._ndarray
    reads = []
    if basic_index(key):
        target = device_range(ndarray_base(nd).__getitem__(a, key))
    else:
        target = device_range(a)
        for k in (key if isinstance(key, tuple) else (key,)):
            if isinstance(k, nd):
                r = device_range(k)
                if r is not None:
                    reads.append(r)
    if isinstance(value, nd):
        r = device_range(value)
        if r is not None:
            reads.append(r)
    elif isinstance(value, t._numpy.ndarray):
        r = host_range(t, value)
        if r is not None:
            reads.append(r)
    return reads, [target] if target is not None else [], 0, None


def d2h(t, args, kwargs, out, pre):
    """ndarray.get(stream, order, out, blocking) and cupy.asnumpy(a, stream, order, out, blocking=)."""
    a = args[0]
    if not isinstance(a, t._ndarray):
        return None
    host = arg(args, kwargs, 3, "out")
    blocking = arg(args, kwargs, 4, "blocking", True)
    r = device_range(a)
    writes = []
    pinned = False
    if host is not None:
        w = host_range(t, host, query=True)
        if w is not None:
            writes.append(w)
            pinned = True
    flags = E.OP_BLOCKING if (blocking or not pinned) else 0
    return [r] if r is not None else [], writes, flags, None


def d2h_value(t, args, kwargs, out, pre):
    """item(), tolist(), int(a)...: a blocking read on the current stream."""
    r = device_range(args[0])
    return [r] if r is not None else [], [], E.OP_BLOCKING, None


def set_h2d(t, args, kwargs, out, pre):
    """ndarray.set(arr, stream): H2D; a pinned source is read by the stream."""
    a, host = args[0], arg(args, kwargs, 1, "arr")
    w = device_range(a)
    reads = []
    if isinstance(host, t._numpy.ndarray):
        r = host_range(t, host, query=True)
        if r is not None:
            reads.append(r)
            t._staged_write(host, r, pre)
    return reads, [w] if w is not None else [], 0, None


def asarray(t, args, kwargs, out, pre):
    """cupy.asarray / array / asanyarray: from NumPy an H2D copy (a pinned source that NumPy must first convert
    is read by the host), from a ``__cuda_array_interface__`` object a D2D copy after CuPy synchronizes the
    producer's stream where the interface names one, from a CuPy array the generic rule."""
    obj = arg(args, kwargs, 0, "obj", arg(args, kwargs, 0, "a"))
    nd = t._ndarray
    if isinstance(obj, nd) or not isinstance(out, nd):
        return generic_accesses(t, args, kwargs, out)
    reads = []
    flags = E.OP_BLOCKING if kwargs.get("blocking") else 0
    np_ = t._numpy
    if isinstance(obj, np_.ndarray):
        r = host_range(t, obj, query=True)
        if r is not None:
            dtype = arg(args, kwargs, 1, "dtype")
            converted = (obj.ndim == 0 or (dtype is not None and np_.dtype(dtype) != obj.dtype)
                         or not (obj.flags.c_contiguous or obj.flags.f_contiguous)
                         or obj.dtype.byteorder == ">")
            if converted:  # NumPy converts it on the host first; the copy reads the converted array
                pre.append((E.OP, E.HOST, "numpy.array", (r,), (), t._cur_stack(), t.ctx, 0))
            else:
                reads.append(r)
                if not flags:
                    t._staged_write(obj, r, pre)
    elif hasattr(obj, "__cuda_array_interface__"):
        try:
            iface = obj.__cuda_array_interface__
        except Exception:
            iface = None
        if iface:
            sp = iface.get("stream")
            if sp is not None and getattr(sys.modules.get("cupy._util"), "CUDA_ARRAY_INTERFACE_SYNC", True):
                dev = out.data.device_id
                pre.append((E.STREAM_SYNC, t._agent(dev, int(sp)), t._cur_stack()))
            mem = out.data.mem
            if type(mem).__name__ == "UnownedMemory":
                return None  # zero-copy
            ptr = iface["data"][0]
            dt = np_.dtype(iface["typestr"])
            shape = tuple(iface["shape"])
            strides = iface.get("strides") or c_strides(shape, dt.itemsize)
            r = strided_range(out.data.device_id, ptr, shape, strides, dt.itemsize)
            if r is not None:
                reads.append(r)
    mem = out.data.mem
    if type(mem).__name__ in ("UnownedMemory", "DLPackMemory"):
        return None
    w = device_range(out)
    return reads, [w] if w is not None else [], flags, {mem.ptr: describe(out)}


def raw_kernel(key):
    """The analysis of a raw kernel launch ``(grid, block, args, ...)`` under annotation key ``key``."""
    return lambda t, a, kw, o, pre: raw_accesses(t, key, a[2])


def raw_accesses(t, key, kargs):
    """Reads/writes of a raw kernel launch: array/MemoryPointer arguments, and integers that point into a live
    allocation (:mod:`..addresses`: from the address to the allocation's end), per the kernel's annotation. A
    launch that reaches pinned memory through an integer is ``OP_UNRECORDED``: no pinned host allocator knows of
    it."""
    ann = ACCESSES.get(key)
    nd = t._ndarray
    reads, writes = [], []
    mp_type = getattr(t.cp.cuda, "MemoryPointer", ())
    for i, v in enumerate(kargs):
        if isinstance(v, nd):
            r = device_range(v)
        elif isinstance(v, mp_type):
            mem = v.mem
            end = int(mem.ptr) + int(mem.size)
            r = (v.device_id, int(v.ptr), end - int(v.ptr)) if end > int(v.ptr) else None
        else:
            r = t.memory.pointed_range(v)
        if r is None:
            continue
        if ann is None:
            writes.append(r)
        elif i in ann.ignore:
            continue
        elif i in ann.reads:
            reads.append(r)
        else:
            writes.append(r)
    # (pinned ranges come from integers only: a raw kernel takes no NumPy arrays)
    flags = E.OP_UNRECORDED if any(r[0] == E.PINNED for r in reads + writes) else 0
    return reads, writes, flags, None


def ndarray_base(nd):
    """The Cython base of ``cupy.ndarray`` where ``cupy.ndarray`` is a Python subclass of it (a heap type: CuPy >=
    13), else ``cupy.ndarray`` itself (an extension type)."""
    return nd.__mro__[1] if nd.__flags__ & (1 << 9) else nd  # 1 << 9: Py_TPFLAGS_HEAPTYPE
