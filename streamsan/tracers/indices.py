"""Index values the tracer knows without reading the GPU, and the rows an index-addressed op touches with them.

``index_select``, ``index_copy_``, ``x[idx]``, ``x[idx] = v``, ``embedding``... touch only the rows their indices
name, but the indices live in device memory, and reading them would synchronize. Without them such an op touches
its whole tensor, so two streams filling and reading disjoint rows of one paged KV cache look like a race. Many
index tensors come from where the tracer can see their values on the host: a copy from host memory (the tracer
reads the source's values at the copy, in host memory, as the copy will), ``torch.tensor(data, device=...)``, or
``torch.arange``; and many are made from those by a few device ops (``.long()``, ``cat``, ``block * size + offset``,
``table[rows]``, ``fill_``), whose results the tracer computes on the host from the values it knows (:data:`DERIVED`).
:class:`IndexValues` keeps those values per device span until a traced op writes the span or its storage dies;
:class:`IndexedOp` says which argument of an op is addressed by which index, and :func:`row_ranges` turns index
values into the ranges of the rows they name.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .pinned_numpy import strided_range

# Index tensors whose values are remembered: the common integer index types, at most this many elements.
INDEX_DTYPES = (torch.int64, torch.int32)
MAX_VALUES = 1 << 14
# Remembered spans at most (the oldest forgotten first), and ranges per indexed access at most (past it, the rows
# from the smallest index to the largest).
MAX_SPANS = 64
MAX_RUNS = 64

_tolist = torch.Tensor.tolist  # (the tracer patches Tensor.tolist into a host read; its own reads are not)
_DisableTorchDispatch = torch._C._DisableTorchDispatch
_new_tensor = torch.tensor  # (the tracer patches torch.tensor; its own host copies need not go through that)

# Device ops whose integer results the tracer computes on the host, by running the same op on host copies of
# inputs whose values it knows (base names; deterministic ops only, no out= overloads).
DERIVED = frozenset({
    "_to_copy", "clone", "cat", "add", "add_", "sub", "sub_", "mul", "mul_", "remainder", "remainder_",
    "floor_divide", "floor_divide_", "div", "div_", "neg", "index", "index_select", "repeat_interleave", "cumsum",
    "flip", "minimum", "maximum", "clamp", "clamp_", "fill_", "copy_",
})


class IndexedOp:
    """Where an index-addressed op's indexed tensor and its indices are: ``target`` (position, name) of the tensor
    whose rows are touched, ``dim`` (position, name) of the dimension argument or the constant dimension,
    ``index`` (position, name) of the index tensor, or of the ``Tensor?[]`` list of indices, one per dimension
    (``indices=True``)."""

    __slots__ = ("target", "dim", "index", "indices")

    def __init__(self, target, dim, index, indices=False):
        self.target, self.dim, self.index, self.indices = target, dim, index, indices

    @staticmethod
    def arg(args, kwargs, where):
        pos, name = where
        return args[pos] if pos < len(args) else kwargs.get(name)

    def dimension(self, args, kwargs) -> int:
        return self.dim if isinstance(self.dim, int) else self.arg(args, kwargs, self.dim)


_SELF, _DIM, _INDEX = (0, "self"), (1, "dim"), (2, "index")
INDEXED_OPS = {
    "aten::index_select": IndexedOp(_SELF, _DIM, _INDEX),
    "aten::index_select.out": IndexedOp(_SELF, _DIM, _INDEX),
    "aten::index_copy_": IndexedOp(_SELF, _DIM, _INDEX),
    "aten::index_add_": IndexedOp(_SELF, _DIM, _INDEX),
    "aten::index_fill_.int_Scalar": IndexedOp(_SELF, _DIM, _INDEX),
    "aten::index_fill_.int_Tensor": IndexedOp(_SELF, _DIM, _INDEX),
    "aten::index_reduce_": IndexedOp(_SELF, _DIM, _INDEX),
    "aten::embedding": IndexedOp((0, "weight"), 0, (1, "indices")),
    "aten::index.Tensor": IndexedOp(_SELF, None, (1, "indices"), indices=True),
    "aten::index.Tensor_out": IndexedOp(_SELF, None, (1, "indices"), indices=True),
    "aten::index_put_": IndexedOp(_SELF, None, (1, "indices"), indices=True),
    "aten::_index_put_impl_": IndexedOp(_SELF, None, (1, "indices"), indices=True),
}


class _Known:
    __slots__ = ("space", "lo", "hi", "dtype", "values", "storage")

    def __init__(self, space, lo, hi, dtype, values, storage):
        self.space, self.lo, self.hi, self.dtype, self.values, self.storage = space, lo, hi, dtype, values, storage


class IndexValues:
    """Values of device index tensors the tracer saw written from the host side.

    ``spans``: [(space, lo, hi)] of the remembered bytes, in step with the entries; the C tracer reads it (the list
    is only ever changed in place) to call the tracer back only for ops that may read or write a span. Threads
    dispatching ops at once share it: changes and lookups hold a lock.
    """

    def __init__(self):
        self.spans: list = []
        self._known: list[_Known] = []
        self._lock = threading.RLock()

    def learn(self, t, values) -> None:
        """``t`` (a contiguous CUDA tensor) now holds ``values`` (a sequence of ints, one per element, or None:
        unknown)."""
        lo = t.data_ptr()
        hi = lo + t.nbytes
        space = t.get_device()
        try:
            storage = weakref.ref(t.untyped_storage())
        except TypeError:
            storage = None
        with self._lock:
            self._forget(space, lo, hi)
            if storage is None or values is None or len(values) != t.numel() or not hi > lo:
                return
            while len(self._known) >= MAX_SPANS:
                self._drop(0)
            self._known.append(_Known(space, lo, hi, t.dtype, values, storage))
            self.spans.append((space, lo, hi))

    def learn_copy(self, dst, src) -> None:
        """A copy from host tensor ``src`` into CUDA tensor ``dst`` (enqueued now: it reads ``src`` as the host
        left it, or races with a host write that is reported)."""
        if (dst.dtype in INDEX_DTYPES and src.dtype in INDEX_DTYPES + (torch.int16, torch.uint8, torch.int8)
                and dst.numel() == src.numel() <= MAX_VALUES and dst.is_contiguous()):
            self.learn(dst, _flat(_tolist(src), src.dim()))

    def learn_data(self, out, data) -> None:
        """``torch.tensor(data, device=...)`` / ``torch.as_tensor`` made CUDA tensor ``out`` from host ``data`` (a
        nest of lists of integers, a NumPy array, a CPU tensor)."""
        if out.dtype not in INDEX_DTYPES or out.numel() > MAX_VALUES or not out.is_contiguous():
            return
        try:
            if isinstance(data, torch.Tensor):
                if not data.is_cpu:
                    return
                values = _flat(_tolist(data), data.dim())
            elif hasattr(data, "ravel") and hasattr(data, "dtype"):  # a NumPy array
                values = data.ravel().tolist()
            else:
                values = list(_ints(data))
        except Exception:  # (floats, strings, anything else: unknown values are always safe)
            return
        if all(type(v) is int for v in values):
            self.learn(out, values)

    def derive(self, plan, args, kwargs):
        """The values an op in :data:`DERIVED` gives, computed on the host from the known values of its CUDA
        inputs (copies of them), or None when one is unknown or the op cannot run so."""
        if plan.name.endswith("out"):  # (out= overloads)
            return None
        try:
            with _DisableTorchDispatch():  # (host work of the tracer's own: no dispatch mode sees it)
                if plan.base == "copy_":  # the destination's old values do not matter
                    dst, src = args[0], self._host(args[1])
                    return torch.empty(tuple(dst.shape), dtype=dst.dtype).copy_(src)
                if plan.base == "fill_":
                    value = args[1]
                    value = self._host(value).item() if isinstance(value, torch.Tensor) else value
                    return torch.full(tuple(args[0].shape), value, dtype=args[0].dtype)
                host_args = [self._host_arg(a) for a in args]
                host_kwargs = {k: ("cpu" if k == "device" else self._host_arg(v)) for k, v in kwargs.items()}
                return plan.func(*host_args, **host_kwargs)
        except Exception:  # an unknown input, or an op the host copies do not suit
            return None

    def _host(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        if not t.is_cuda:
            return t
        values = self.values_of(t)
        if values is None:
            raise LookupError("unknown values")
        return _new_tensor(list(values), dtype=t.dtype).reshape(tuple(t.shape))

    def _host_arg(self, a):
        if isinstance(a, (list, tuple)):
            return type(a)(self._host(x) for x in a)
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return self._host(a)

    def learn_arange(self, out, args, kwargs) -> None:
        """``torch.arange``'s output: start, start + step, ... (integers only)."""
        if out.dtype not in INDEX_DTYPES or out.numel() > MAX_VALUES or not out.is_contiguous():
            return
        nums = [a for a in args if not isinstance(a, torch.Tensor)]
        if len(nums) == 1:
            start, step = 0, 1
        elif len(nums) in (2, 3):
            start, step = nums[0], nums[2] if len(nums) == 3 else 1
        else:
            return
        if type(start) is not int or type(step) is not int or step == 0:
            return
        self.learn(out, range(start, start + step * out.numel(), step))

    def values_of(self, t):
        """The values of CUDA tensor ``t`` (flattened, row-major), or None when they are not known."""
        if not self._known or t.dtype not in INDEX_DTYPES or not t.is_contiguous():
            return None
        p = t.data_ptr()
        n = t.numel()
        space = t.get_device()
        with self._lock:
            found = next((k for k in self._known if k.space == space and k.lo <= p and p + t.nbytes <= k.hi
                          and k.dtype == t.dtype), None)
        if found is None or found.storage() is not t.untyped_storage():  # (a dead storage's reference is None)
            return None
        first = (p - found.lo) // t.element_size()
        return found.values[first:first + n]

    def written(self, ranges) -> None:
        """Forget what ``ranges`` (an op's writes) may have overwritten: the values of the elements outside them
        stay known."""
        if not self.spans or not ranges:
            return
        with self._lock:
            for r in ranges:
                self._forget(r[0], r[1], r[1] + r[2])

    def _forget(self, space, lo, hi) -> None:
        """(Under the lock.) Forget the values of [lo, hi), and those of storages that died."""
        known = self._known
        for i in range(len(known) - 1, -1, -1):
            k = known[i]
            if k.space == space and k.lo < hi and lo < k.hi:
                self._drop(i)
                its = k.dtype.itemsize
                for a, b in ((k.lo, lo), (hi, k.hi)):  # the parts before and after the written bytes
                    if a < b and (a - k.lo) % its == 0 and (b - k.lo) % its == 0:
                        part = _Known(space, a, b, k.dtype, k.values[(a - k.lo) // its:(b - k.lo) // its], k.storage)
                        known.append(part)
                        self.spans.append((space, a, b))
            elif k.storage() is None:
                self._drop(i)

    def _drop(self, i) -> None:
        del self.spans[i]
        del self._known[i]


def indexed_rows(spec: IndexedOp, args, kwargs, known: IndexValues):
    """(the indexed CUDA tensor, the ranges of the rows the op touches in it), or None when its indices' values
    are not known. An op with several index tensors (``x[i, j]``) touches at most the rows of one of them."""
    t = spec.arg(args, kwargs, spec.target)
    if not isinstance(t, torch.Tensor) or not t.is_cuda or t.dim() == 0:
        return None
    if spec.indices:
        dim = 0
        values = None
        for ix in spec.arg(args, kwargs, spec.index) or ():
            if ix is None:
                dim += 1
                continue
            if ix.dtype in (torch.bool, torch.uint8):  # a mask: as many dimensions as it has
                dim += ix.dim()
                continue
            values = _values(ix, known)
            if values is not None:
                break
            dim += 1
        if values is None:
            return None
    else:
        dim = spec.dimension(args, kwargs)
        ix = spec.arg(args, kwargs, spec.index)
        if not isinstance(ix, torch.Tensor) or type(dim) is not int:
            return None
        values = _values(ix, known)
        if values is None:
            return None
        if dim < 0:
            dim += t.dim()
    if not 0 <= dim < t.dim():
        return None
    rows = rows_of(values, t.shape[dim])
    if not rows:
        return None
    return t, row_ranges(t.get_device(), t.data_ptr(), t.element_size(), t.shape, t.stride(), dim, rows)


def _values(ix, known: IndexValues):
    if ix.is_cuda:
        return known.values_of(ix)
    if ix.is_cpu and ix.dtype in INDEX_DTYPES and ix.numel() <= MAX_VALUES:  # (the op copies it to the device)
        return _flat(_tolist(ix), ix.dim())
    return None


def _ints(data):
    """The integers of a nest of lists and tuples, in order."""
    if isinstance(data, (list, tuple)):
        for x in data:
            yield from _ints(x)
    else:
        yield data.__index__()


def flat_values(t) -> list:
    """A host tensor's values, flattened row-major."""
    return _flat(_tolist(t), t.dim())


def _flat(values, ndim):
    if ndim == 0:
        return [values]
    for _ in range(ndim - 1):
        values = [v for row in values for v in row]
    return values


def rows_of(values, size):
    """The sorted distinct rows ``values`` name along a dimension of ``size`` (negative values count from the end,
    as ``x[idx]`` reads them), or None when one is out of bounds (the op fails; nothing is refined)."""
    rows = set()
    for v in values:
        if v < 0:
            v += size
        if not 0 <= v < size:
            return None
        rows.add(v)
    return sorted(rows)


def row_ranges(space, ptr, itemsize, sizes, strides, dim, rows):
    """The ranges of the rows ``rows`` (sorted, distinct) along ``dim`` of a view (``ptr`` its first element,
    strides in elements): one per run of consecutive rows, or the hull from the first to the last past MAX_RUNS."""
    runs = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    if len(runs) > MAX_RUNS:
        runs = [[rows[0], rows[-1] + 1]]
    byte_strides = [s * itemsize for s in strides]
    shape = list(sizes)
    out = []
    for a, b in runs:
        shape[dim] = b - a
        r = strided_range(space, ptr + a * byte_strides[dim], shape, byte_strides, itemsize)
        if r is not None:
            out.append(r)
    return out
