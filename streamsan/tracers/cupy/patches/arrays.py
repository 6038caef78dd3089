"""Patch: the methods and operators of ``cupy.ndarray``. Since CuPy 13 ``cupy.ndarray`` is a Python subclass of
the Cython ``_ndarray_base``, so its methods and operator slots can be overridden on it; every array CuPy returns is
a ``cupy.ndarray``, and Cython code that calls ``cpdef`` methods (``copy``, ``astype``...) on one also reaches the
override. With an older CuPy (an extension type) nothing on arrays is traced, and a note says so.

Array arguments are read; in-place methods and operators write the array; ``__setitem__`` writes the indexed
view (basic index) or the whole array (advanced index); returned arrays with new memory are written; views are no
access at all. ``item``, ``tolist``, ``int(a)``... are blocking reads. (``get`` / ``set``: :mod:`.copies`.)
"""

from __future__ import annotations

from .. import analyses
from ..analyses import ndarray_base
from ..patching import Patches
from ..wrappers import traced_method

_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
           "rshift", "divmod")
_GENERIC = tuple(f"__{op}__" for op in _BINARY) + tuple(f"__r{op}__" for op in _BINARY) + (
    "__neg__", "__pos__", "__abs__", "__invert__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__getitem__", "__copy__", "__deepcopy__",
    "all", "any", "argmax", "argmin", "argpartition", "argsort", "astype", "choose", "clip", "compress", "conj",
    "conjugate", "copy", "cumprod", "cumsum", "diagonal", "dot", "flatten", "max", "mean", "min", "nonzero",
    "prod", "ptp", "ravel", "repeat", "reshape", "round", "searchsorted", "squeeze", "std", "sum", "swapaxes",
    "take", "trace", "transpose", "var", "byteswap",
)
_INPLACE = ("fill", "sort", "partition", "put", "scatter_add", "scatter_max", "scatter_min") + tuple(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
                            "lshift", "rshift", "div"))
_D2H = ("item", "tolist", "tobytes", "tofile", "__int__", "__float__", "__complex__", "__bool__", "__index__")


def install(tracer):
    patches = Patches(tracer, "arrays")
    with patches:
        cp = tracer.cp
        nd = cp.ndarray
        if ndarray_base(nd) is nd:
            tracer._trouble(f"cupy {cp.__version__}: cupy.ndarray is an extension type (CuPy < 13), so array "
                            "methods and operators are not traced; only streams, events, copies, kernels and "
                            "allocations are")
            return patches.undo
        gen = analyses.generic(())
        for attr in _GENERIC:
            override(patches, nd, attr, gen)
        inpl = analyses.generic((0,))
        for attr in _INPLACE:
            override(patches, nd, attr, inpl)
        for attr in _D2H:
            override(patches, nd, attr, analyses.d2h_value)
        override(patches, nd, "__setitem__", analyses.setitem)
    return patches.undo


def override(patches, nd, attr, analyze, stream_of=None, name=None) -> None:
    """Trace ``cupy.ndarray.<attr>`` (the method of its Cython base), unless ``cupy.ndarray`` defines it itself.
    Only for a ``cupy.ndarray`` that is a Python subclass (:func:`..analyses.ndarray_base`)."""
    fn = getattr(ndarray_base(nd), attr, None)
    if fn is None or attr in vars(nd):
        return
    patches.replace(nd, attr, traced_method(fn, name or "cupy.ndarray." + attr, analyze, stream_of))
