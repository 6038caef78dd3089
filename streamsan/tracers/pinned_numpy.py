"""NumPy views of pinned host memory whose host accesses a tracer sees.

:func:`pinned_class` is an ``ndarray`` subclass (values and memory unchanged; it pickles as a plain array): its
ufunc calls (``p.sum()``, ``p + 1``, ``p += 1``), NumPy functions (``np.copyto(p, ...)``, ``np.sum(p)``), the
methods that touch memory (``fill``, ``sort``, ``copy``, ``astype``, ``item``, ``tolist``, ``tobytes``...) and
indexing are reported, when they happen, as host accesses of the bytes they touch. A tracer hands such views out
(the CuPy tracer for ``cupyx.*_pinned``, the torch tracer for ``Tensor.numpy()`` of pinned memory) and attaches
itself while it runs (:func:`attach`): an owner answers ``pinned_range(array)`` (the PINNED range of an array over
its pinned memory, or None) and takes ``host_op(name, reads, writes)``. With no owner attached the views behave
exactly as plain arrays.
"""

from __future__ import annotations

_owners: list = []  # the attached tracers, the latest first


def attach(owner) -> None:
    if owner not in _owners:
        _owners.insert(0, owner)


def detach(owner) -> None:
    if owner in _owners:
        _owners.remove(owner)


def _owner():
    """The tracer whose accesses these are (the latest attached), or None; a guard keeps a bug of streamsan's
    out of the program's NumPy calls."""
    return _Guarded(_owners[0] if len(_owners) == 1 else _Owners()) if _owners else None


class _Guarded:
    """An owner whose failures cost the access, never the program's call (logged once)."""

    __slots__ = ("owner",)

    def __init__(self, owner):
        self.owner = owner

    def pinned_range(self, a):
        try:
            return self.owner.pinned_range(a)
        except Exception as exc:
            _log_once(exc)
            return None

    def host_op(self, name, reads, writes):
        try:
            self.owner.host_op(name, reads, writes)
        except Exception as exc:
            _log_once(exc)


_logged: list = []


def _log_once(exc) -> None:
    if not _logged:
        import logging

        _logged.append(exc)
        logging.getLogger("streamsan").error("internal error in a pinned NumPy view's access", exc_info=exc)


class _Owners:
    """Several attached tracers (torch and CuPy in one session): ranges from whichever knows the memory, host
    accesses through the first that knew one."""

    def __init__(self):
        self.first = None

    def pinned_range(self, a):
        for o in _owners:
            r = o.pinned_range(a)
            if r is not None:
                if self.first is None:
                    self.first = o
                return r
        return None

    def host_op(self, name, reads, writes):
        (self.first or _owners[0]).host_op(name, reads, writes)


def pinned_types() -> tuple:
    return (_PINNED_CLASS,) if _PINNED_CLASS is not None else ()


def strided_range(space, ptr, shape, strides, itemsize):
    """The range of a view (strides in bytes, any sign), or None when it is empty."""
    lo = ptr
    extent = itemsize
    n = 1
    sizes = []
    st = []
    exact = True
    for sz, s in zip(shape, strides):
        if sz == 0:
            return None
        n *= sz
        if sz == 1:
            continue
        if s < 0:
            lo += (sz - 1) * s
            s = -s
        extent += (sz - 1) * s
        if s % itemsize:
            exact = False
        sizes.append(sz)
        st.append(s // itemsize)
    if not exact:
        return (space, lo, extent)
    if extent == n * itemsize and 0 not in st:
        return (space, lo, extent)
    return (space, lo, extent, (itemsize, tuple(sizes), tuple(st)))


def basic_index(key) -> bool:
    """Whether an index makes a view (basic indexing), not a copy."""
    items = key if isinstance(key, tuple) else (key,)
    for k in items:
        if k is None or k is Ellipsis or isinstance(k, slice):
            continue
        if isinstance(k, bool):
            return False
        if isinstance(k, int) or type(k).__name__ in ("int8", "int16", "int32", "int64", "uint8", "uint16",
                                                      "uint32", "uint64", "intp", "intc", "longlong"):
            continue
        return False
    return True



_PINNED_CLASS = None

# NumPy functions that only look at metadata (no host access), and those whose first argument is written.
_NP_META = frozenset({
    "shape", "ndim", "size", "result_type", "can_cast", "may_share_memory", "shares_memory", "iscomplexobj",
    "isrealobj", "isfortran", "broadcast_to", "broadcast_arrays", "reshape", "ravel", "transpose", "squeeze",
    "expand_dims", "swapaxes", "moveaxis", "rollaxis", "atleast_1d", "atleast_2d", "atleast_3d", "empty_like",
    "zeros_like", "ones_like", "full_like", "asarray", "asanyarray", "ascontiguousarray", "asfortranarray",
    "require", "split", "array_split", "hsplit", "vsplit", "dsplit", "diagonal", "real", "imag", "ndindex",
})
_NP_WRITE0 = frozenset({"copyto", "put", "place", "putmask", "fill_diagonal", "put_along_axis", "shuffle"})
# ndarray methods that read the whole array without a ufunc or a NumPy function (seen as one read each, run on a
# plain view: their results are plain, and repr() says ``array``); iteration counts as one read when it starts.
_NP_READ_METHODS = ("argmax", "argmin", "argsort", "nonzero", "searchsorted", "dot", "take", "compress", "repeat",
                    "choose", "tofile", "dump", "dumps", "__iter__", "__bool__", "__float__", "__int__", "__index__",
                    "__complex__", "__repr__", "__str__", "__format__", "__contains__")


def pinned_class():
    """The NumPy subclass whose host accesses the attached tracers see (made on first use: NumPy is imported
    then)."""
    global _PINNED_CLASS
    if _PINNED_CLASS is not None:
        return _PINNED_CLASS
    import numpy

    plain = numpy.ndarray

    def rng(t, a):
        return t.pinned_range(a)

    def unwrap(v, acc, t):
        if isinstance(v, PinnedArray):
            if t is not None:
                r = rng(t, v)
                if r is not None:
                    acc.append(r)
            return v.view(plain)
        return v

    def rewrap(v, t):
        if isinstance(v, plain) and not isinstance(v, PinnedArray) and t is not None and v.size:
            if rng(t, v) is not None:
                return v.view(PinnedArray)
        return v

    class PinnedArray(plain):
        """A NumPy view of pinned (page-locked) memory whose host accesses streamsan sees."""

        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            t = _owner()
            reads, writes = [], []
            ins = [unwrap(x, reads, t) for x in inputs]
            outs = kwargs.get("out")
            if outs is not None:
                kwargs["out"] = tuple(unwrap(o, writes, t) for o in outs)
            if method == "at" and inputs and isinstance(inputs[0], PinnedArray) and t is not None:
                r = rng(t, inputs[0])
                if r is not None:
                    writes.append(r)
            result = getattr(ufunc, method)(*ins, **kwargs)
            if t is not None:
                name = f"numpy.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
                t.host_op(name, reads, writes)
            if outs is not None and method != "at":
                return outs[0] if len(outs) == 1 else outs
            return result

        def __array_function__(self, func, types_, args, kwargs):
            t = _owner()
            name = getattr(func, "__name__", "function")
            reads, writes = [], []

            def conv(v):
                if isinstance(v, (list, tuple)):
                    return type(v)(unwrap(x, reads, t) for x in v)
                return unwrap(v, reads, t)

            if name in _NP_WRITE0 and args and isinstance(args[0], PinnedArray) and t is not None:
                r = rng(t, args[0])
                if r is not None:
                    writes.append(r)
            o = kwargs.get("out")
            if isinstance(o, PinnedArray) and t is not None:
                r = rng(t, o)
                if r is not None:
                    writes.append(r)
            nargs = [conv(a) for a in args]
            nkw = {k: conv(v) for k, v in kwargs.items()}
            result = func(*nargs, **nkw)
            if t is not None:
                if name not in _NP_META:
                    t.host_op(f"numpy.{name}", reads, writes)
                if isinstance(result, (list, tuple)):
                    result = type(result)(rewrap(x, t) for x in result) if isinstance(result, list) else tuple(
                        rewrap(x, t) for x in result)
                else:
                    result = rewrap(result, t)
            if isinstance(o, PinnedArray) and result is not None and not isinstance(result, PinnedArray):
                return o
            return result

        def _access(self, name, write, read=True):
            t = _owner()
            if t is not None:
                r = rng(t, self)
                if r is not None:
                    t.host_op(f"numpy.ndarray.{name}", (r,) if read else (), (r,) if write else ())

        def fill(self, value):
            plain.fill(self, value)
            self._access("fill", True, False)

        def sort(self, *args, **kwargs):
            plain.sort(self, *args, **kwargs)
            self._access("sort", True)

        def partition(self, *args, **kwargs):
            plain.partition(self, *args, **kwargs)
            self._access("partition", True)

        def put(self, *args, **kwargs):
            plain.put(self, *args, **kwargs)
            self._access("put", True, False)

        def copy(self, *args, **kwargs):
            r = plain.copy(self.view(plain), *args, **kwargs)
            self._access("copy", False)
            return r

        def astype(self, *args, **kwargs):
            r = plain.astype(self.view(plain), *args, **kwargs)
            self._access("astype", False)
            return r

        def item(self, *args):
            r = plain.item(self, *args)
            self._access("item", False)
            return r

        def tolist(self):
            r = plain.tolist(self)
            self._access("tolist", False)
            return r

        def tobytes(self, *args, **kwargs):
            r = plain.tobytes(self, *args, **kwargs)
            self._access("tobytes", False)
            return r

        def __getitem__(self, key):
            r = plain.__getitem__(self, key)
            t = _owner()
            if t is None:
                return r
            if basic_index(key):
                if isinstance(r, plain):
                    return r  # a view: no access
                elem = plain.__getitem__(self, (key if isinstance(key, tuple) else (key,)) + (Ellipsis,))
                rr = rng(t, elem)
                t.host_op("numpy.ndarray.__getitem__", (rr,) if rr else (), ())
                return r
            self._access("__getitem__", False)  # advanced indexing: a copy
            return r.view(plain) if isinstance(r, PinnedArray) else r

        def __setitem__(self, key, value):
            plain.__setitem__(self, key, value.view(plain) if isinstance(value, PinnedArray) else value)
            t = _owner()
            if t is None:
                return
            reads = []
            if isinstance(value, PinnedArray):
                r = rng(t, value)
                if r is not None:
                    reads.append(r)
            if basic_index(key):
                target = plain.__getitem__(self, key)
                if not isinstance(target, plain):
                    target = plain.__getitem__(self, (key if isinstance(key, tuple) else (key,)) + (Ellipsis,))
                w = rng(t, target)
            else:
                w = rng(t, self)
            t.host_op("numpy.ndarray.__setitem__", reads, (w,) if w else ())

        def __reduce__(self):
            return self.view(plain).__reduce__()

    def reader(name):
        meth = getattr(plain, name)

        def read(self, *args, **kwargs):
            r = meth(self.view(plain), *args, **kwargs)
            self._access(name, False)
            return r
        read.__name__ = name
        read.__doc__ = meth.__doc__
        return read

    for name in _NP_READ_METHODS:
        setattr(PinnedArray, name, reader(name))
    _PINNED_CLASS = PinnedArray
    return PinnedArray
