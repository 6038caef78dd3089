"""Patch: user kernels. ``cupy.ElementwiseKernel`` / ``ReductionKernel`` / ``RawKernel`` / ``RawModule`` (in ``cupy``
and ``cupy._core``) are replaced by transparent subclasses whose launches are traced (elementwise and reduction:
input parameters read, output parameters written; a ``stream=`` argument is honoured). A raw kernel's array and
``MemoryPointer`` arguments are read-and-write unless declared with :func:`..annotations.cupy_access`.
``RawModule.get_function`` returns a traced proxy of the ``Function``; ``cupyx.jit.rawkernel`` kernels (when
``cupyx.jit`` is imported) and ``cupy.matmul`` (a gufunc) are traced by patching their Python classes. Kernel
objects made before the tracer started keep the untraced classes.
"""

from __future__ import annotations

import functools
import sys

from .. import active, analyses
from ..annotations import cuda_parameter_names
from ..patching import Patches
from ..wrappers import transparent_subclass


def _kw_stream(args, kwargs):
    return kwargs.get("stream")


def _launch_stream(args, kwargs):
    """The stream of a launch ``(grid, block, args, shared_mem, stream)``."""
    return args[4] if len(args) > 4 else kwargs.get("stream")


def install(tracer):
    patches = Patches(tracer, "kernels")
    with patches:
        cp = tracer.cp
        core = getattr(cp, "_core", None)
        EK, RK, RawK, RawM = cp.ElementwiseKernel, cp.ReductionKernel, cp.RawKernel, cp.RawModule

        def ek_call(k, *args, **kwargs):
            tr = active.tracer
            if tr is None:
                return EK.__call__(k, *args, **kwargs)
            nin, nargs = k.nin, k.nargs
            return tr._op("cupy.ElementwiseKernel:" + k.name, functools.partial(EK.__call__, k), args, kwargs,
                          analyses.generic(range(nin, nargs)), _kw_stream)

        def rk_call(k, *args, **kwargs):
            tr = active.tracer
            if tr is None:
                return RK.__call__(k, *args, **kwargs)
            return tr._op("cupy.ReductionKernel:" + k.name, functools.partial(RK.__call__, k), args, kwargs,
                          analyses.generic(range(k.nin, max(len(args), k.nin))), _kw_stream)

        def raw_call(k, grid, block, args, **kwargs):
            tr = active.tracer
            if tr is None:
                return RawK.__call__(k, grid, block, args, **kwargs)
            return tr._op("cupy.RawKernel:" + k.name, functools.partial(RawK.__call__, k), (grid, block, args),
                          kwargs, analyses.raw_kernel(("raw", k.code, k.name)), _kw_stream)

        def get_function(m, name):
            fn = RawM.get_function(m, name)
            src = m.code if m.code is not None else getattr(m, "file_path", None)
            return _TracedFunction(fn, ("mod", src, name), cuda_parameter_names(m.code, name) if m.code else None,
                                   name)

        classes = (
            ("ElementwiseKernel", EK, {"__call__": ek_call}),
            ("ReductionKernel", RK, {"__call__": rk_call}),
            ("RawKernel", RawK, {"__call__": raw_call}),
            ("RawModule", RawM, {"get_function": get_function}),
        )
        for name, cls, body in classes:
            sub = transparent_subclass(cls, name, body)
            patches.replace(cp, name, sub)
            if core is not None and getattr(core, name, None) is cls:
                patches.replace(core, name, sub)

        gufuncs = sys.modules.get("cupy._core._gufuncs")
        G = getattr(gufuncs, "_GUFunc", None)
        if G is not None and "__call__" in vars(G):
            orig = vars(G)["__call__"]

            def gu_call(g, *args, **kwargs):
                tr = active.tracer
                if tr is None:
                    return orig(g, *args, **kwargs)
                name = getattr(g, "__name__", None) or getattr(g, "_name", "gufunc")
                return tr._op("cupy." + str(name), functools.partial(orig, g), args, kwargs, analyses.generic(()))

            patches.replace(G, "__call__", functools.wraps(orig)(gu_call))

    def patch_jit(jit):
        with patches:
            iface = sys.modules.get("cupyx.jit._interface")
            J = getattr(iface, "_JitRawKernel", None)
            if J is None or "__call__" not in vars(J):
                return
            orig = vars(J)["__call__"]

            def call(k, grid, block, args, *rest, **kwargs):
                tr = active.tracer
                if tr is None:
                    return orig(k, grid, block, args, *rest, **kwargs)
                name = getattr(k._func, "__name__", "kernel")
                return tr._op("cupyx.jit.rawkernel:" + name, functools.partial(orig, k),
                              (grid, block, args) + rest, kwargs, analyses.raw_kernel(("jit", id(k._func))),
                              _launch_stream)

            patches.replace(J, "__call__", functools.wraps(orig)(call))

    tracer.on_import("cupyx.jit", patch_jit)
    return patches.undo


class _TracedFunction:
    """A ``cupy.cuda.function.Function`` from a traced ``RawModule``: launches are traced, the rest delegates."""

    def __init__(self, fn, key, names, name):
        self._fn = fn
        self._streamsan_key = key
        self._streamsan_names = names
        self._name = name

    def __call__(self, grid, block, args, *rest, **kwargs):
        t = active.tracer
        if t is None:
            return self._fn(grid, block, args, *rest, **kwargs)
        return t._op("cupy.RawModule:" + self._name, self._fn, (grid, block, args) + rest, kwargs,
                     analyses.raw_kernel(self._streamsan_key), _launch_stream)

    def __getattr__(self, item):
        return getattr(self._fn, item)

    @property
    def __class__(self):
        return type(self._fn)

    def __repr__(self):
        return repr(self._fn)
