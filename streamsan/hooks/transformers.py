"""transformers hooks: labels and context for the cache classes of transformers 5.x (``cache_utils``).

Around ``Cache.update`` / ``Cache.prefetch`` / ``Cache.offload`` and every cache layer class's ``offload`` /
``prefetch`` / ``update`` (including linear-attention conv and recurrent states and indexer keys), the hooks

* name the cache's ``prefetch_stream`` and the default stream for reports,
* label the layer's tensors (``cache.layers[3].keys``, ``cache.layers[5].conv_states[0]``, ...),
* attach the call as context to every access made inside (``transformers Cache.prefetch(layer_idx=4)``),
* and, in ``--scope hooks``, turn tracing on only while inside them.

They only observe: every wrapper calls the original with the same arguments and returns its result. For a
transformers version they do not know, they install nothing and warn once.
"""

from __future__ import annotations

import functools
import sys
import threading

from streamsan.imports import when_imported
from streamsan.session import current

SUPPORTED_MAJOR = 5
LAYER_METHODS = ("offload", "prefetch", "update", "update_conv_state", "update_recurrent_state", "update_indexer")
CACHE_METHODS = ("update", "prefetch", "offload", "update_conv_state", "update_recurrent_state", "update_indexer")
_state = threading.local()


def install(session, transformers_module) -> None:
    """Called when the traced program imports transformers."""
    version = str(getattr(transformers_module, "__version__", "0"))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = -1
    if major != SUPPORTED_MAJOR:
        session._note(f"transformers {version} is not a version the transformers hooks know (5.x): "
                      "races are still found, without cache labels")
        return
    when_imported("transformers.cache_utils", lambda mod: _patch(session, mod))


def _patch(session, cu) -> None:
    if getattr(cu, "_streamsan_patched", False):
        return
    if not all(hasattr(cu, n) for n in ("Cache", "CacheLayerMixin")) or not hasattr(cu.Cache, "update"):
        session._note("transformers.cache_utils does not have the Cache classes the hooks expect: "
                      "races are still found, without cache labels")
        return
    for name, cls in list(vars(cu).items()):
        if not isinstance(cls, type) or cls.__module__ != cu.__name__:
            continue
        if issubclass(cls, cu.Cache):
            methods = CACHE_METHODS
        elif issubclass(cls, cu.CacheLayerMixin) or name.endswith("LayerMixin") or name.endswith("Layer"):
            methods = LAYER_METHODS
        else:
            continue
        for m in methods:
            fn = cls.__dict__.get(m)
            if fn is None or getattr(fn, "__streamsan__", False) or not callable(fn):
                continue
            wrapper = (_wrap_cache if issubclass(cls, cu.Cache) else _wrap_layer)(cls.__name__, m, fn)
            setattr(cls, m, wrapper)
    cu._streamsan_patched = True


def _tracer():
    """The torch tracer of the session active now: the classes are patched once per process, and each later
    session (``pytest --streamsan`` runs one per test) is served by the same wrappers."""
    session = current()
    t = session.tracers.get("torch") if session is not None and session.active else None
    return t if t is not None and t.running else None


def _wrap_cache(clsname, method, fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        tracer = _tracer()
        if tracer is None or (tracer.scope == "hooks" and not getattr(self, "offloading", False)):
            return fn(self, *args, **kwargs)  # hooks scope: a cache without offloading uses no second stream
        layer_idx = _layer_idx(method, args, kwargs)
        _name_streams(tracer, self)
        stack = getattr(_state, "caches", None)
        if stack is None:
            stack = _state.caches = []
        stack.append(self)
        prev = tracer.push_context(_context(tracer, f"Cache.{method}(layer_idx={layer_idx})"))
        try:
            return fn(self, *args, **kwargs)
        finally:
            tracer.pop_context(prev)
            stack.pop()
            if method in ("update", "update_conv_state", "update_recurrent_state", "update_indexer") \
                    and isinstance(layer_idx, int) and layer_idx < len(getattr(self, "layers", ())):
                _label_layer(tracer, self.layers[layer_idx], layer_idx)

    wrapper.__streamsan__ = True
    return wrapper


def _wrap_layer(clsname, method, fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        tracer = _tracer()
        if tracer is None or (tracer.scope == "hooks" and not getattr(_state, "caches", None)):
            return fn(self, *args, **kwargs)
        idx = _index_in_cache(self)
        where = f"layer {idx}" if idx is not None else "layer ?"
        prev = tracer.push_context(_context(tracer, f"{clsname}.{method}() [{where}]"))
        try:
            return fn(self, *args, **kwargs)
        finally:
            tracer.pop_context(prev)
            if method in ("offload", "prefetch") and idx is not None:
                _label_layer(tracer, self, idx)

    wrapper.__streamsan__ = True
    return wrapper


def _context(tracer, call: str) -> str:
    outer = tracer.buffer.context_text(tracer.ctx) if tracer.ctx else ""
    return f"{outer} > {call}" if outer else f"transformers {call}"


def _layer_idx(method, args, kwargs):
    if "layer_idx" in kwargs:
        return kwargs["layer_idx"]
    pos = 0 if method == "prefetch" or method == "offload" else (1 if method in (
        "update_conv_state", "update_recurrent_state", "update_indexer") else 2)
    return args[pos] if len(args) > pos else None


def _index_in_cache(layer):
    for cache in reversed(getattr(_state, "caches", None) or ()):
        for i, lay in enumerate(getattr(cache, "layers", ())):
            if lay is layer:
                return i
    return None


def _name_streams(tracer, cache) -> None:
    s = getattr(cache, "prefetch_stream", None)
    if s is None or getattr(cache, "_streamsan_named", None) is tracer.streams:  # named in this session already
        return
    try:
        tracer.name_stream(s, "prefetch_stream")
    except Exception:  # a stream we cannot key: reports fall back to the stream handle
        pass
    cache._streamsan_named = tracer.streams


def _label_layer(tracer, layer, idx: int) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    base = f"cache.layers[{idx}]"
    for attr in ("keys", "values", "indexer_keys"):
        t = getattr(layer, attr, None)
        if isinstance(t, torch.Tensor):
            tracer.label(t, f"{base}.{attr}")
    for attr in ("conv_states", "recurrent_states"):
        states = getattr(layer, attr, None)
        if isinstance(states, dict):
            for j, t in states.items():
                if isinstance(t, torch.Tensor):
                    tracer.label(t, f"{base}.{attr}[{j}]")
