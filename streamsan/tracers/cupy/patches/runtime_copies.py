"""Patch: the copies and memsets of ``cupy.cuda.runtime`` (``memcpy``, ``memcpyAsync``, ``memcpy2DAsync``,
``memcpyPeerAsync``, ``memset``, ``memsetAsync``), each traced as an op on its stream (the legacy default stream
for the synchronous ones). The space of each pointer comes from the known pinned blocks or
``cudaPointerGetAttributes``, which never synchronizes; pageable host memory is not tracked. A copy from the device
into pageable memory, and a synchronous ``memcpy`` to or from host memory, is one the host waits for."""

from __future__ import annotations

from .... import events as E
from ..patching import Patches
from ..ranges import pitched_range, pointer_space
from ..wrappers import traced_function


def _copy(dst_i, src_i, size_fn, legacy_sync=False):
    """The analysis of a linear copy: destination and source at argument positions ``dst_i`` / ``src_i``."""
    def an(tr, args, kwargs, out, pre):
        dst, src = int(args[dst_i]), int(args[src_i])
        size = size_fn(args)
        ds, ss = pointer_space(tr, dst), pointer_space(tr, src)
        reads = [(ss, src, size)] if ss is not None and size > 0 else []
        writes = [(ds, dst, size)] if ds is not None and size > 0 else []
        flags = 0
        if ds is None and ss is not None and ss >= 0:  # device -> pageable: CUDA returns when done
            flags = E.OP_BLOCKING
        if legacy_sync and (ds == E.PINNED or (ds is None and ss is not None)
                            or (ss == E.PINNED and ds is not None and ds >= 0)):
            flags = E.OP_BLOCKING  # synchronous cudaMemcpy to or from host memory
        return reads, writes, flags, None
    return an


def _memset(tr, args, kwargs, out, pre):
    ptr, size = int(args[0]), int(args[2])
    sp = pointer_space(tr, ptr)
    return [], [(sp, ptr, size)] if sp is not None and size > 0 else [], 0, None


def _memcpy2d(tr, args, kwargs, out, pre):
    dst, dpitch, src, spitch, width, height = (int(x) for x in args[:6])
    ds, ss = pointer_space(tr, dst), pointer_space(tr, src)
    reads = [pitched_range(ss, src, spitch, width, height)] if ss is not None else []
    writes = [pitched_range(ds, dst, dpitch, width, height)] if ds is not None else []
    flags = E.OP_BLOCKING if ds is None and ss is not None and ss >= 0 else 0
    return [r for r in reads if r], [w for w in writes if w], flags, None


def _peer(tr, args, kwargs, out, pre):
    dst, ddev, src, sdev, size = int(args[0]), int(args[1]), int(args[2]), int(args[3]), int(args[4])
    if size <= 0:
        return None
    return [(sdev, src, size)], [(ddev, dst, size)], 0, None


def _legacy(args, kwargs):
    """cudaMemcpy / cudaMemset: the legacy default stream."""
    return 0


# (name, the stream of a call, its analysis)
_CALLS = (
    ("memcpyAsync", lambda a, k: int(a[4]) if len(a) > 4 else k.get("stream", 0),
     _copy(0, 1, lambda a: int(a[2]))),
    ("memcpy", _legacy, _copy(0, 1, lambda a: int(a[2]), legacy_sync=True)),
    ("memsetAsync", lambda a, k: int(a[3]) if len(a) > 3 else k.get("stream", 0), _memset),
    ("memset", _legacy, _memset),
    ("memcpy2DAsync", lambda a, k: int(a[7]) if len(a) > 7 else k.get("stream", 0), _memcpy2d),
    ("memcpyPeerAsync", lambda a, k: int(a[5]) if len(a) > 5 else k.get("stream", 0), _peer),
)


def install(tracer):
    patches = Patches(tracer, "runtime copies")
    with patches:
        rt = tracer.cp.cuda.runtime
        for name, stream_of, an in _CALLS:
            orig = getattr(rt, name, None)
            if orig is not None:
                patches.replace(rt, name, traced_function(orig, "cupy.cuda.runtime." + name, an, stream_of))
    return patches.undo
