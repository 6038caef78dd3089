"""The contract between the torch tracer and its C core (``streamsan/_ctracer.c``), and loading the core.

The C core reads and calls Python objects by name: the protocols below list every attribute and method it may
touch, on the tracer, its event buffer, its stack table, an op's plan, the known index values, the GPU trace
registry, tensors and their storages, and the keyword arguments of an op it looks at. Nothing else of the tracer
is the core's business, so anything not listed can change freely; ``tests/native/test_ccore_contract.py`` checks the
listing against the names the C source interns.

The constants the core needs (event codes, plan kinds, the field positions of the tuples it reads and makes)
are passed to it by :func:`configured`, from the Python definitions, instead of being repeated in C.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from ... import events as E
from ...stacks import USER
from . import device
from .placement import OP_FIELDS
from .rules import ARG_FIELDS, FAST_ACCESSES, FAST_ALLOCATING, FAST_FIELDS, FAST_UNTOUCHED
from .tensors import DESCRIPTIONS, describe


class CoreTracer(Protocol):
    """What the core reads and calls on a torch tracer."""

    tracing: bool
    plans: dict  # id(op overload) -> OpPlan
    buffer: CoreBuffer
    ctx: int
    agent_of: dict  # (device, stream handle) -> agent
    op_agent: tuple | None  # the op being dispatched (placement.OP_FIELDS)
    saw_cuda: bool
    index_values: CoreIndexValues
    engine_threads: set
    engine_grads: set
    stacks: CoreStacks
    in_scope: int
    live_device: dict  # block pointer -> device
    pool_of_thread: dict

    def agent(self, device: int, handle: int) -> int: ...
    def agent_for_handle(self, handle: int) -> int: ...
    def range_in(self, t, space: int): ...
    def output_ranges(self, out, writes: list) -> None: ...
    def place(self, evs: list, mark: int, op: tuple, out) -> None: ...
    def fill_alloc_sizes(self, evs: list, mark: int, out) -> None: ...
    def engine_op(self, evs: list, plan, args, kwargs, out, agent: int, stack: int) -> None: ...
    def values_after(self, plan, args, kwargs, out, reads: list, writes: list) -> None: ...
    def stop_on_bug(self, exc: BaseException, where: str) -> None: ...


class CoreBuffer(Protocol):
    """What the core reads and calls on the tracer's event buffer (:class:`streamsan.sink.EventBuffer`)."""

    events: list
    ops_of_threads: dict  # thread -> the op it is dispatching
    batch: int

    def flush(self) -> None: ...


class CoreStacks(Protocol):
    """What the core reads and calls on the stack table (:class:`streamsan.stacks.StackTable`)."""

    kinds: dict  # id(code) -> OWN, LIBRARY or USER
    ids: dict  # stack key -> stack id
    key_users: int
    max_key: int

    def classify(self, code) -> int: ...
    def define(self, events: list, key: tuple, frame) -> int: ...
    def no_frames(self, events: list) -> int: ...


class CorePlan(Protocol):
    """What the core reads of an op's plan (:class:`.rules.OpPlan`)."""

    fast: tuple  # laid out as rules.FAST_FIELDS


class CoreIndexValues(Protocol):
    """What the core reads of the known index values (:class:`streamsan.tracers.indices.IndexValues`)."""

    spans: list  # (space, lo, hi) of known values


class CoreGpuTrace(Protocol):
    """What the core reads of the GPU trace registry (:class:`.callbacks.GpuTrace`)."""

    active: CoreTracer | None


class CoreTensor(Protocol):
    """What the core reads and calls on a tensor, and on its untyped storage (``nbytes``)."""

    nbytes: int
    dtype: object
    shape: tuple

    def data_ptr(self) -> int: ...
    def is_contiguous(self) -> bool: ...
    def get_device(self) -> int: ...
    def untyped_storage(self): ...
    def stride(self) -> tuple: ...
    def element_size(self) -> int: ...


class CoreOpKeywords(Protocol):
    """The keyword arguments of an op the core looks at."""

    pin_memory: bool
    device: object


PROTOCOLS = (CoreTracer, CoreBuffer, CoreStacks, CorePlan, CoreIndexValues, CoreGpuTrace, CoreTensor,
             CoreOpKeywords)


def members(protocol) -> frozenset:
    """The attribute and method names a protocol lists."""
    own = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return frozenset(own | set(vars(protocol).get("__annotations__", {})))


# The events' field positions the core reads and makes (streamsan.events documents each event's fields)
OP_EVENT = {"kind": 0, "agent": 1, "name": 2, "reads": 3, "writes": 4, "stack": 5, "ctx": 6, "flags": 7}
ALLOC_EVENT = {"kind": 0, "space": 1, "start": 2, "size": 3, "agent": 4, "stack": 5, "ctx": 6, "what": 7}
FREE_EVENT = {"kind": 0, "space": 1, "start": 2, "stack": 3}
STREAM_EVENT = {"kind": 0, "event": 1, "agent": 2, "stack": 3}  # EVENT_RECORD and EVENT_WAIT

# The kinds of the core's Callback: PyTorch's allocation, free, and event record or wait callback
CALLBACK_ALLOC, CALLBACK_FREE, CALLBACK_EVENT = 0, 1, 2


def configuration() -> dict:
    """The keyword arguments of the core's ``configure``: the objects and constants it works with."""
    return {
        "tensor_type": torch.Tensor, "raw_stream": device.raw_stream, "describe": describe,
        "descriptions": DESCRIPTIONS, "op": E.OP, "alloc": E.ALLOC, "free": E.FREE, "user_kind": USER,
        "device_attr": device.ATTR, "device_offset": device.OFFSET,
        "plan_kinds": {"untouched": FAST_UNTOUCHED, "allocating": FAST_ALLOCATING, "accesses": FAST_ACCESSES},
        "callback_kinds": {"alloc": CALLBACK_ALLOC, "free": CALLBACK_FREE, "event": CALLBACK_EVENT},
        "layouts": {"fast": FAST_FIELDS, "arg": ARG_FIELDS, "current_op": OP_FIELDS, "op": OP_EVENT,
                    "alloc": ALLOC_EVENT, "free": FREE_EVENT, "stream_event": STREAM_EVENT},
    }


def configured():
    """The C core (``streamsan/_ctracer.c``), configured for the tracer as :mod:`.device` says now, or None: not
    built (no C compiler at install), Python before 3.11, or ``STREAMSAN_CORE=python`` in the environment."""
    if os.environ.get("STREAMSAN_CORE", "").strip().lower() == "python" or device.raw_stream is None:
        return None
    try:
        from ... import _ctracer
    except ImportError:
        return None
    if not getattr(_ctracer, "AVAILABLE", 0):
        return None
    _ctracer.configure(**configuration())
    return _ctracer
