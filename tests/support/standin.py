"""A CPU stand-in for the GPU: the real torch tracer, with CPU tensors playing CUDA's part.

:func:`cpu_as_cuda` sets the tracer's device configuration (:mod:`streamsan.tracers.torch.device`, which the C core
gets at ``configure``) so that CPU tensors count as tensors of device 0, on stream 7
(or the handle a program puts in :data:`CURRENT_STREAM`), and puts it back after.
:class:`StandIn` runs programs under the tracer's dispatch mode (with its C core where built) on top of that: each
fresh output is announced as an allocation through PyTorch's GPU trace registries, as CUDA's allocator would, and
freed 8 ops later, between ops: through the registries' ``fire_callbacks`` directly, or, after
:func:`through_slot`, through the interpreter in PyTorch's GPU-trace slot as CUDA code does (the native observer's
or PyTorch's own). ``tests/native/test_ctracer.py`` compares the C core and the Python path on it, and
``bench/standin.py`` measures the tracer's cost on it without a GPU.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.cuda._gpu_trace as gt
from torch.utils._python_dispatch import TorchDispatchMode

from streamsan.agents import StreamRegistry
from streamsan.sink import EventBuffer
from streamsan.stacks import StackTable
from streamsan.tracers.torch import ccore, device
from streamsan.tracers.torch.callbacks import GpuTrace
from streamsan.tracers.torch.dispatch import TracingMode
from streamsan.tracers.torch.tracer import TorchTracer

CURRENT_STREAM = [7]  # the raw handle of the stand-in's current stream (7, the default, unless a program switches)

# The registries the stand-in fires, and the native observer's code of each kind of event.
_KINDS = {"alloc": (gt.MemoryAllocationCallbacks, 5), "free": (gt.MemoryDeallocationCallbacks, 6),
          "record": (gt.EventRecordCallbacks, 3), "wait": (gt.EventWaitCallbacks, 4)}
_SLOT = [None]  # the observer's extension while events go through the slot


def fire(kind: str, *args) -> None:
    """A GPU-trace event of ``kind`` (alloc, free, record, wait), as CUDA code would fire it."""
    registry, code = _KINDS[kind]
    # (one line: a stack captured at the event has the same frames whichever way it goes)
    registry.fire_callbacks(*args) if _SLOT[0] is None else _SLOT[0].fire_trace_event(code, *args)


def through_slot(carrier: str) -> str:
    """From now on, fire events through PyTorch's GPU-trace slot, holding the ``carrier``: ``native`` (the torch
    tracer's choice where CUDA is there) or ``python`` (PyTorch's own interpreter). Once per process, before any
    tracer starts; "" on success, else why not."""
    from streamsan.native import observer
    from streamsan.tracers.torch import trace_slot

    module, why = observer.load()
    if module is None:
        return why
    if carrier == "python":
        os.environ["STREAMSAN_GPU_TRACE"] = "python"
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # (the stand-in's tensors are CUDA's)
    try:
        trace_slot.activate()
    finally:
        torch.cuda.is_available = available
    if trace_slot.CARRIER != carrier:
        return f"the slot's carrier is {trace_slot.describe()}"
    _SLOT[0] = module
    return ""


@contextlib.contextmanager
def cpu_as_cuda():
    """CPU tensors are device tensors of device 0 (their ``get_device()`` says -1) on stream 7, for the tracer and
    its C core, inside the block."""
    saved = device.ATTR, device.OFFSET, device.raw_stream, device.current
    device.ATTR, device.OFFSET = "is_cpu", 1
    device.raw_stream, device.current = (lambda dev: CURRENT_STREAM[0]), (lambda: 0)
    try:
        ccore.configured()
        yield
    finally:
        device.ATTR, device.OFFSET, device.raw_stream, device.current = saved


class NoOp(TorchDispatchMode):
    """A dispatch mode that only runs the op (the floor under the tracer's cost)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class StandIn:
    """A context in which :meth:`enter` puts a stand-in mode on (``cpu_as_cuda`` holds throughout); its tracers'
    batches go to ``consumer``; every op's output is appended to the list ``keep`` if one is given (no address is
    then reused).

    Modes: ``plain`` (none), ``floor`` (a no-op dispatch mode), ``trace`` (with the C core where built),
    ``trace-python`` (the Python path alone), ``trace-inactive`` (the mode and the harness without the tracer's
    work), ``trace-nostack`` (stack capture replaced by a constant), ``trace-nocb`` (allocation callbacks reaching
    no tracer)."""

    def __init__(self, consumer=None, keep=None):
        self.consumer = consumer
        self.keep = keep
        self.live: list = []  # data pointers of outputs announced, freed 8 ops later
        self.wrappers: dict = {}
        self.announcing = _announcing_class(keep, self.live)
        self._device = None
        self._plan = None

    def __enter__(self) -> StandIn:
        self._device = cpu_as_cuda()
        self._device.__enter__()
        self._plan = TorchTracer.plan
        standin = self

        def plan_of_wrapped(tracer, func):  # filed under the wrapper; the plan calls the op through it
            p = tracer.plans[id(func)] = standin._plan(tracer, func.func)
            func.run, p.call = p.call, func
            p.fast = (p.fast[0], func) + p.fast[2:]
            return p
        TorchTracer.plan = plan_of_wrapped
        GpuTrace.install()
        return self

    def __exit__(self, *exc) -> None:
        TorchTracer.plan = self._plan
        GpuTrace.active = None
        self._device.__exit__(*exc)

    def enter(self, name):
        """The mode ``name`` entered (None for plain)."""
        if name == "plain":
            return None
        if name == "floor":
            m = NoOp()
        else:
            os.environ["STREAMSAN_CORE"] = "python" if "python" in name else ""
            buf = EventBuffer([self.consumer or (lambda evs: None)])
            tr = TorchTracer(buf, StreamRegistry(buf), StackTable())
            tr.running = tr.tracing = "inactive" not in name
            if "nocb" in name:
                GpuTrace.active = None  # (the callbacks reach no tracer, and are still called)
            else:
                GpuTrace.attach(tr)
            if "nostack" in name:
                tr.stacks.capture = lambda events, skip=1: 0
            m = self._traced(tr)
        m.__enter__()
        return m

    def _traced(self, tracer):
        """The tracer's mode (its C core too, where built), behind a function that frees between ops."""
        wrappers, live, announcing = self.wrappers, self.live, self.announcing

        class Traced(TracingMode):
            def __init__(self, tracer):
                super().__init__(tracer)
                inner = self.__dict__.get("__torch_dispatch__") or super().__torch_dispatch__

                def dispatch(func, types, args=(), kwargs=None):
                    w = wrappers.get(func)
                    if w is None:
                        w = wrappers[func] = announcing(func)
                    if len(live) > 8:
                        fire("free", live.pop(0))  # a tensor dropped between ops
                    return inner(w, types, args, kwargs)
                dispatch.__self__ = self  # (PyTorch checks that a mode's __torch_dispatch__ is bound)
                self.__torch_dispatch__ = dispatch

        return Traced(tracer)


def _announcing_class(keep, live):
    """The class of op overloads that announce their fresh output's storage as an allocation, as CUDA's allocator
    does (``live``: the pointers announced, not freed yet)."""

    class Announcing:
        __slots__ = ("func", "run")

        def __init__(self, func):
            self.func = func
            self.run = func  # what the tracer would call for the op itself (set with its plan)

        def __call__(self, *a, **k):
            out = self.run(*a, **k)
            if keep is not None:
                keep.append(out)
            if isinstance(out, torch.Tensor):
                p = out.untyped_storage().data_ptr()
                if p not in live:
                    live.append(p)
                    fire("alloc", p)
            return out

        def __getattr__(self, name):
            return getattr(self.func, name)

    return Announcing
