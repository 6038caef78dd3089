"""The objects that stand in for CuPy's while a tracer runs: traced functions and methods, and transparent
subclasses that replace a class under its public name.

A traced function or method runs each call through the running tracer (:mod:`.active`) as one op, analyzed by
its analysis (:mod:`.analyses`); with no tracer running it calls the original directly. Traced callables carry
``_streamsan_traced`` so that no surface is wrapped twice.
"""

from __future__ import annotations

import functools

from . import active


def traced_function(fn, name, analyze, stream_of=None):
    """``fn`` traced as the op ``name`` (``stream_of(args, kwargs)``: the stream it runs on; None: the current
    stream)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = active.tracer
        if t is None:
            return fn(*args, **kwargs)
        return t._op(name, fn, args, kwargs, analyze, stream_of)

    wrapper._streamsan_traced = True
    return wrapper


def traced_method(fn, name, analyze, stream_of=None):
    """:func:`traced_function` for a method (of an extension type too, whose metadata may not copy)."""
    def method(*args, **kwargs):
        t = active.tracer
        if t is None:
            return fn(*args, **kwargs)
        return t._op(name, fn, args, kwargs, analyze, stream_of)

    try:
        functools.update_wrapper(method, fn)
    except (AttributeError, TypeError):
        pass
    method._streamsan_traced = True
    return method


def transparent_subclass(base, name, body):
    """A subclass that replaces ``base`` under its public name: instances of ``base`` made elsewhere still pass
    ``isinstance(x, <the subclass>)``."""

    class Meta(type(base)):
        def __instancecheck__(cls, obj):
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, base)

    ns = dict(body)
    ns["__module__"] = base.__module__
    ns["__doc__"] = base.__doc__
    ns["__qualname__"] = name
    return Meta(name, (base,), ns)
