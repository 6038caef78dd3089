"""Patch: the public functions of ``cupy`` and, once imported, of ``cupy.linalg``, ``cupy.fft``, ``cupy.random``
(with ``RandomState``'s methods), ``cupyx`` and ``cupyx.scipy.{ndimage,signal,special,fft,linalg}``. Functions are
replaced by traced wrappers; ufunc objects (``cupy.add``...) by transparent proxies (``isinstance(cupy.add,
cupy.ufunc)`` still holds) whose ``__call__`` / ``reduce`` / ``accumulate`` / ``reduceat`` / ``outer`` / ``at`` are
traced. Array arguments are read; ``out=`` / ``output=`` and the targets of the known in-place functions are
written; new result arrays are written. cuBLAS, cuSOLVER and cuFFT work behind these functions is covered at this
level, on the current stream as CuPy uses it. Functions that touch no array memory, and those traced elsewhere
(:mod:`.copies`, :mod:`.pinned`), are left alone.
"""

from __future__ import annotations

import types

from .. import active, analyses
from ..patching import Patches
from ..wrappers import traced_function, traced_method

_LEFT_ALONE = frozenset({
    "get_array_module", "get_default_memory_pool", "get_default_pinned_memory_pool", "show_config",
    "is_available", "fuse", "memoize", "clear_memo", "result_type", "can_cast", "min_scalar_type",
    "promote_types", "common_type", "shape", "ndim", "size", "isscalar", "iscomplexobj", "isrealobj",
    "issubdtype", "issubsctype", "obj2sctype", "sctype2char", "typename", "mintypecode", "may_share_memory",
    "shares_memory", "broadcast_shapes", "binary_repr", "base_repr", "set_printoptions", "get_printoptions",
    "printoptions", "format_float_positional", "format_float_scientific", "get_include", "isfortran",
    "iterable", "empty", "empty_like", "from_dlpack", "fromDlpack", "make_aligned_dtype", "get_runtime_info",
    "seterr", "geterr", "errstate", "allow_synchronize", "get_random_state", "set_random_state", "seed",
    "reset_states", "default_rng", "time", "empty_pinned", "empty_like_pinned", "zeros_pinned",
    "zeros_like_pinned", "asnumpy", "asarray", "array", "asanyarray", "get_plan_cache", "set_plan_cache",
    "show_plan_cache_info", "get_fft_plan",
})
# in-place functions: the positions of the arguments they write
_IN_PLACE = {
    "copyto": (0,), "put": (0,), "place": (0,), "putmask": (0,), "fill_diagonal": (0,), "shuffle": (0,),
    "scatter_add": (0,), "scatter_max": (0,), "scatter_min": (0,),
}
MODULES = ("cupy.linalg", "cupy.fft", "cupy.random", "cupyx", "cupyx.scipy.ndimage", "cupyx.scipy.signal",
           "cupyx.scipy.special", "cupyx.scipy.fft", "cupyx.scipy.linalg")


def install(tracer):
    patches = Patches(tracer, "namespaces")
    with patches:
        _patch_namespace(tracer, patches, tracer.cp, "cupy.")
    done: set = set()  # the modules of MODULES patched so far

    def patch_module(module):
        with patches:
            name = getattr(module, "__name__", "")
            if name in MODULES and name not in done:
                done.add(name)
                _patch_namespace(tracer, patches, module, name + ".")
                if module.__name__ == "cupy.random":
                    _patch_random_state(patches, module)

    for name in MODULES:
        tracer.on_import(name, patch_module)
    return patches.undo


def _patch_namespace(tracer, patches, module, prefix) -> None:
    ufunc = tracer.cp.ufunc
    for k, v in list(vars(module).items()):
        if (k.startswith("_") or k in _LEFT_ALONE or isinstance(v, (type, types.ModuleType))
                or type(v) is _UfuncProxy):
            continue
        if isinstance(v, ufunc):
            patches.replace(module, k, _UfuncProxy(v, prefix + k))
        elif type(v).__name__ in ("function", "builtin_function_or_method", "cython_function_or_method",
                                  "fused_cython_function"):
            if getattr(v, "_streamsan_traced", False):
                continue
            patches.replace(module, k, traced_function(v, prefix + k, analyses.generic(_IN_PLACE.get(k, ()))))


def _patch_random_state(patches, module) -> None:
    RS = getattr(module, "RandomState", None)
    if isinstance(RS, type):
        for attr, v in list(vars(RS).items()):
            if (not attr.startswith("_") and isinstance(v, types.FunctionType)
                    and not getattr(v, "_streamsan_traced", False)):
                patches.replace(RS, attr, traced_method(
                    v, "cupy.random.RandomState." + attr, analyses.generic(_IN_PLACE.get(attr, ()))))


class _UfuncProxy:
    """Stands for a ``cupy.ufunc`` in a namespace: calls and ufunc methods are traced, the rest delegates."""

    def __init__(self, uf, name):
        self._uf = uf
        self._name = name
        self.__doc__ = getattr(uf, "__doc__", None)
        self.__name__ = getattr(uf, "__name__", name.rsplit(".", 1)[-1])

    def __call__(self, *args, **kwargs):
        t = active.tracer
        if t is None:
            return self._uf(*args, **kwargs)
        nin = self._uf.nin
        return t._op(self._name, self._uf, args, kwargs, analyses.generic(range(nin, len(args))))

    def _method(self, meth, inplace, *args, **kwargs):
        f = getattr(self._uf, meth)
        t = active.tracer
        if t is None:
            return f(*args, **kwargs)
        return t._op(f"{self._name}.{meth}", f, args, kwargs, analyses.generic(inplace))

    def reduce(self, *args, **kwargs):
        return self._method("reduce", (3,), *args, **kwargs)

    def accumulate(self, *args, **kwargs):
        return self._method("accumulate", (3,), *args, **kwargs)

    def reduceat(self, *args, **kwargs):
        return self._method("reduceat", (4,), *args, **kwargs)

    def outer(self, *args, **kwargs):
        return self._method("outer", (), *args, **kwargs)

    def at(self, *args, **kwargs):
        return self._method("at", (0,), *args, **kwargs)

    def __getattr__(self, item):
        return getattr(self._uf, item)

    @property
    def __class__(self):
        return type(self._uf)

    def __repr__(self):
        return repr(self._uf)
