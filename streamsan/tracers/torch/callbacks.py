"""PyTorch's GPU trace callbacks (allocations, frees, event records and waits, synchronizations, event deletions):
the process-wide registry routing (:class:`GpuTrace`) and the handlers that turn each into events of the active
torch tracer.
"""

from __future__ import annotations

import threading

import torch

from ... import events as E
from . import ccore, device, trace_slot

_ALLOC, _FREE = E.ALLOC, E.FREE
_get_ident = threading.get_ident


class GpuTrace:
    """Routes PyTorch's process-wide GPU trace callbacks to the attached tracer (they cannot be unregistered; the
    native carrier stops forwarding to them while no tracer is attached and no one else's callback is registered).

    PyTorch calls each registry's ``fire_callbacks``, a Python loop over its callbacks. On the registries it uses,
    streamsan makes its own callback that method while it is the only one there (one Python call per allocation,
    free or event), and a loop that calls streamsan's first and then the others once someone else (CSAN, a
    profiler) registers one. An exception in any callback is logged, never raised into PyTorch."""

    active = None  # the tracer the callbacks feed: set through attach() and detach()
    installed = False
    ours: list = []  # the callbacks streamsan registered
    python_callbacks = ()  # (allocation, free, event record, event wait): the Python callbacks (the C ones fall
    # back on them)

    lock = threading.Lock()  # (attach, detach and someone else's registration decide the carrier's quiet in turn)

    @classmethod
    def attach(cls, tracer) -> None:
        """Feed ``tracer`` from now on."""
        with cls.lock:
            cls.active = tracer
            trace_slot.quiet(False)

    @classmethod
    def detach(cls, tracer=None) -> None:
        """Feed no tracer (if ``tracer`` is given: if it is the one fed). With no one else's callback registered,
        the native carrier then forwards nothing: a program that traced once runs on without the callbacks' cost."""
        with cls.lock:
            if tracer is None or cls.active is tracer:
                cls.active = None
                if not cls._others_registered():
                    trace_slot.quiet(True)

    @classmethod
    def heard(cls) -> None:
        """Someone else registered a callback: the events are forwarded from now on, tracer or not."""
        with cls.lock:
            trace_slot.quiet(False)

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        import torch.cuda._gpu_trace as gt

        trace_slot.activate()

        def on(registry, handler, capturing=False):
            def callback(*args):
                t = cls.active
                if t is not None and (t.tracing or capturing and t.graphs.current is not None):
                    try:
                        handler(t, *args)
                    except Exception:
                        _log_callback_error(registry.name)
            return callback

        def alloc_callback(ptr):  # the hottest two, spelled out: an op's own allocation, and a free
            t = cls.active
            if t is not None and t.tracing:
                try:
                    cur = t.op_agent
                    if cur is not None and cur[4] == _get_ident() and not t.pool_of_thread:
                        t.live_device[ptr] = cur[0]
                        cur[5].append((_ALLOC, cur[0], ptr, 0, cur[1], cur[2], cur[3], ""))
                    else:
                        on_alloc(t, ptr)
                except Exception:
                    _log_callback_error(gt.MemoryAllocationCallbacks.name)

        def free_callback(ptr):
            t = cls.active
            # (a block allocated while tracing and freed during a graph capture that tracing began in, still a free:
            # it goes back to its stream's free lists, not to the graph's pool)
            if t is not None and (t.tracing or t.graphs.current is not None and t.graphs.current[2]):
                try:
                    dev = t.live_device.pop(ptr, None)
                    if dev is not None:
                        t.emit((_FREE, dev, ptr, 0))
                        if t.engine_grads:
                            t.engine_grads.discard(ptr)
                except Exception:
                    _log_callback_error(gt.MemoryDeallocationCallbacks.name)

        record_callback = on(gt.EventRecordCallbacks, on_event_record, capturing=True)  # (also edges of a graph)
        wait_callback = on(gt.EventWaitCallbacks, on_event_wait, capturing=True)
        cls.python_callbacks = (alloc_callback, free_callback, record_callback, wait_callback)
        core = ccore.configured()
        if core is not None:  # their common case in C
            alloc_callback = core.Callback(cls, alloc_callback, ccore.CALLBACK_ALLOC)
            free_callback = core.Callback(cls, free_callback, ccore.CALLBACK_FREE)
            record_callback = core.Callback(cls, record_callback, ccore.CALLBACK_EVENT, E.EVENT_RECORD)
            wait_callback = core.Callback(cls, wait_callback, ccore.CALLBACK_EVENT, E.EVENT_WAIT)
        for registry, callback in (
                (gt.EventDeletionCallbacks, on(gt.EventDeletionCallbacks, on_event_delete)),
                (gt.EventRecordCallbacks, record_callback), (gt.EventWaitCallbacks, wait_callback),
                (gt.MemoryAllocationCallbacks, alloc_callback), (gt.MemoryDeallocationCallbacks, free_callback),
                (gt.DeviceSynchronizationCallbacks, on(gt.DeviceSynchronizationCallbacks, on_device_sync)),
                (gt.StreamSynchronizationCallbacks, on(gt.StreamSynchronizationCallbacks, on_stream_sync)),
                (gt.EventSynchronizationCallbacks, on(gt.EventSynchronizationCallbacks, on_event_sync))):
            call_directly(registry, callback)
            cls.ours.append(callback)
        for registry in (gt.EventCreationCallbacks, gt.StreamCreationCallbacks):  # (none of streamsan's there)
            _hear_additions(registry)
        cls.installed = True

    @classmethod
    def _others_registered(cls) -> bool:
        """Whether a callback of someone else's is in any of PyTorch's GPU-trace registries."""
        import torch.cuda._gpu_trace as gt

        ours = {id(cb) for cb in cls.ours}
        for value in vars(gt).values():
            if value.__class__.__name__ == "CallbackRegistry" and any(
                    id(cb) not in ours for cb in getattr(value, "callback_list", ())):
                return True
        return False


def call_directly(registry, ours) -> None:
    """Register ``ours`` (which logs its own errors) on a registry and make it the registry's ``fire_callbacks``
    while it is the only callback there; once there are others, ``fire_callbacks`` calls ours, then them (and the
    events are forwarded whether or not a tracer is attached)."""
    registry.add_callback(ours)
    _hear_additions(registry, lambda: setattr(registry, "fire_callbacks", _direct_fire(registry, ours)))
    registry.fire_callbacks = ours if len(registry.callback_list) == 1 else _direct_fire(registry, ours)


def _hear_additions(registry, then=None) -> None:
    """A callback added to ``registry`` from now on (after ``then()``) has the events forwarded again (see
    :meth:`GpuTrace.detach`)."""
    add = registry.add_callback

    def add_callback(cb):
        add(cb)
        if then is not None:
            then()
        GpuTrace.heard()

    registry.add_callback = add_callback


def _direct_fire(registry, ours):
    """A registry's ``fire_callbacks``: streamsan's callback first, then any others registered there."""
    others = registry.callback_list

    def fire(*args):
        ours(*args)
        for cb in others:
            if cb is not ours:
                try:
                    cb(*args)
                except Exception:
                    _log_callback_error(registry.name)
    return fire


def _log_callback_error(what: str) -> None:
    import logging

    logging.getLogger("streamsan").exception("exception in a GPU trace callback for %s", what)


def on_event_delete(tracer, e):
    """A CUDA event was destroyed (its handle may be reused)."""
    tracer.buffer.events.append((E.EVENT_DELETE, e))


def callback_stack(tracer) -> int:
    """The stack of a callback's event: inside an op of this thread, the op's own (the same stack, already
    captured); else captured here."""
    cur = tracer.op_of_this_thread()
    if cur is not None:
        return cur[2]
    return tracer.stacks.outside(tracer.buffer.events)


def on_event_record(tracer, e, s):
    """Event ``e`` was recorded on the stream of handle ``s`` (during a capture: an edge of the graph)."""
    ev = (E.EVENT_RECORD, e, tracer.agent_for_handle(s), callback_stack(tracer))
    cap = tracer.graphs.current
    if cap is not None and not tracer.tracing:  # an edge of the graph being captured
        cap[3].append(ev)
    else:
        tracer.emit(ev)


def on_event_wait(tracer, e, s):
    """The stream of handle ``s`` waits for event ``e`` (during a capture: an edge of the graph)."""
    ev = (E.EVENT_WAIT, e, tracer.agent_for_handle(s), callback_stack(tracer))
    cap = tracer.graphs.current
    if cap is not None and not tracer.tracing:
        cap[3].append(ev)
    else:
        tracer.emit(ev)


def on_stream_sync(tracer, s):
    """The host waited for the stream of handle ``s``."""
    tracer.emit((E.STREAM_SYNC, tracer.agent_for_handle(s), callback_stack(tracer)))


def on_event_sync(tracer, e):
    """The host waited for event ``e``."""
    tracer.emit((E.EVENT_SYNC, e, callback_stack(tracer)))


def on_device_sync(tracer):
    """The host waited for every stream of the current device."""
    tracer.emit((E.DEVICE_SYNC, device.current(), callback_stack(tracer)))


def on_alloc(tracer, ptr):
    """A block allocated at ``ptr``, unsized (the op that made it sizes it): owned by the stream of the op this
    thread dispatches, else by the current stream; in the thread's memory pool, if ``use_mem_pool`` routes it to
    one. (:class:`GpuTrace` handles an op's own allocation itself.)"""
    pool = tracer.pool_of_thread.get(_get_ident(), 0) if tracer.pool_of_thread else 0
    tail = (pool,) if pool else ()
    cur = tracer.op_of_this_thread()
    if cur is None:  # outside an op
        if not tracer.in_scope:
            return
        dev = device.current()
        cur = (dev, tracer.agent(dev, device.raw_stream(dev)), 0, 0)
        tracer.live_device[ptr] = dev
        tracer.emit((E.ALLOC, dev, ptr, 0, cur[1], 0, 0, "") + tail)
        return
    dev, owner = cur[0], cur[1]
    if dev < 0:  # inside a host op: the current stream's allocation
        dev = device.current()
        owner = tracer.agent(dev, device.raw_stream(dev))
    tracer.live_device[ptr] = dev
    cur[5].append((E.ALLOC, dev, ptr, 0, owner, cur[2], cur[3], "") + tail)
