"""Patch: copies between host and device. ``ndarray.get`` / ``cupy.asnumpy`` (device to host: a host
synchronization unless ``blocking=False`` into pinned memory; into pageable memory CUDA returns only once the copy
is done), ``ndarray.set`` and ``cupy.asarray`` / ``array`` / ``asanyarray`` (host to device, or from a
``__cuda_array_interface__`` object; :func:`..analyses.asarray`). (The runtime's memcpy calls:
:mod:`.runtime_copies`.)
"""

from __future__ import annotations

from .. import analyses
from ..analyses import arg, ndarray_base
from ..patching import Patches
from ..wrappers import traced_function
from .arrays import override


def install(tracer):
    patches = Patches(tracer, "copies")
    with patches:
        cp = tracer.cp
        nd = cp.ndarray
        if ndarray_base(nd) is not nd:  # (CuPy < 13: arrays are not traced)
            override(patches, nd, "get", analyses.d2h, lambda a, k: arg(a, k, 1, "stream"))
            override(patches, nd, "set", analyses.set_h2d, lambda a, k: arg(a, k, 2, "stream"))
        functions = {
            "asnumpy": (analyses.d2h, lambda a, k: arg(a, k, 1, "stream")),
            "asarray": (analyses.asarray, None),
            "array": (analyses.asarray, None),
            "asanyarray": (analyses.asarray, None),
        }
        for name, (an, stream_of) in functions.items():
            orig = getattr(cp, name, None)
            if orig is not None:
                patches.replace(cp, name, traced_function(orig, "cupy." + name, an, stream_of))
    return patches.undo
