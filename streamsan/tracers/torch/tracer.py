"""The torch tracer's state and lifecycle (:class:`TorchTracer`): start and stop (the dispatch mode, the GPU trace
callbacks, the patches), agents and names of streams, labels, hooked regions (contexts), notes, and emitting the
events fired outside an op's dispatch. What it watches, and how, is in the package's modules (see the package).
"""

from __future__ import annotations

import functools
import sys
import threading

from ... import events as E
from ...agents import StreamRegistry
from ...stacks import StackTable
from ..addresses import LiveMemory
from ..indices import IndexValues
from ..notes import Notes, warning
from ..pinned import PinnedBlocks
from ..pinned_numpy import attach, detach, strided_range
from ..staging import PinnedStaging, host_access
from . import device, lane, patches
from .allocators import ALLOCATOR, allocations_unreported
from .callbacks import GpuTrace
from .cuda_graphs import GraphCaptures
from .dispatch import TracingMode, dynamo_safe, values_after
from .engine import engine_op, engine_stack
from .host_memory import HostViews
from .patches import triton
from .placement import fill_alloc_sizes, place
from .rules import OpPlan
from .tensors import output_ranges, range_in, range_of, storage_base

_get_ident = threading.get_ident

MAX_ATTRIBUTES = 30


class TorchTracer:
    """Feeds events about the torch program into ``buffer`` (a :class:`streamsan.sink.EventBuffer`); a
    :class:`streamsan.tracers.protocol.Tracer` and a :class:`streamsan.tracers.protocol.PinnedMemoryOwner`.

    ``streams`` / ``stacks``: the session's shared stream registry and stack table. ``scope="full"`` traces
    every op from :meth:`start`; ``scope="hooks"`` traces ops only inside :meth:`push_context` regions (entered by
    library hooks), and allocations and synchronizations from the first such region on.

    The C core reads and calls the attributes and methods :class:`.ccore.CoreTracer` lists; the methods it calls
    that are not the tracer's own concern are the modules' functions, bound here.
    """

    range_in = range_in
    output_ranges = output_ranges
    place = place
    fill_alloc_sizes = fill_alloc_sizes
    engine_op = engine_op
    values_after = values_after

    def __init__(self, buffer, streams=None, stacks=None, scope: str = "full"):
        # Fewer than MAX_ATTRIBUTES instance attributes: past CPython's limit for key-sharing instance dicts every
        # attribute load of the hot path becomes a dict lookup.
        self.buffer = buffer
        self.scope = scope
        self.streams = streams if streams is not None else StreamRegistry(buffer)
        self.agent_of = self.streams.agent_of
        self.stacks = stacks if stacks is not None else StackTable()
        # id(op overload) -> its plan (the plan holds the overload, so the id stays its own). Not keyed by the
        # overload itself: its __hash__ is a Python method, a frame per op.
        self.plans: dict = {}
        self.live_device: dict[int, int] = {}
        self.pinned = PinnedBlocks()  # base pointer -> bytes of pinned host blocks seen
        self.ctx = 0
        self.op_agent = None  # the op being dispatched (placement.OP_FIELDS), for its allocations
        self.saw_cuda = False
        self.running = False
        self.tracing = False  # running, and not inside a CUDA graph capture
        self.graphs = GraphCaptures()
        self.in_scope = 1 if scope == "full" else 0  # hooks scope: inside hooked regions (any thread)
        self.modes: list = []
        self.noted = Notes()
        self.on_note = None  # the session's note function (also tells the user once); else a NOTE event
        self.scope_depth = threading.local()
        self.undo_patches: list = []
        self.record_stream_seen = None  # the thread whose dispatch mode last saw a record_stream
        self.stacks.fallback = functools.partial(engine_stack, self)
        self.backward_site: tuple = ()  # report frames of the latest backward() / autograd.grad() call
        # the autograd engine (.engine): its threads (met running backward ops without Python frames), the stacks
        # of such ops, and the blocks of the gradients they made that are still alive
        self.engine_threads: set[int] = set()
        self.engine_stacks: set[int] = set()
        self.engine_grads: set[int] = set()
        self.views = HostViews()
        self.staged = PinnedStaging(storage_base)  # pinned blocks' bytes as asynchronous copies read them
        self.pool_of_thread: dict[int, int] = {}  # thread -> the memory pool its allocations go to (use_mem_pool)
        self.index_values = IndexValues()  # device index tensors' values seen on the host (copies, arange)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if "torch._dynamo" in sys.modules:
            dynamo_safe()
        allocations_unreported(self)  # (known now if CUDA is up)
        if self.scope == "full":
            GpuTrace.install()
        GpuTrace.attach(self)
        self.running = self.tracing = True
        for install in patches.SURFACES:
            self.undo_patches.append(install(self))
        attach(self)
        lane.attach(self, TracingMode)
        if self.scope == "full":
            self.enter_mode()
            threading.setprofile(self._thread_start)

    def stop(self) -> None:
        if not self.running:
            return
        opened = self.views.opened
        while opened:  # NumPy views still alive are read at the latest now
            self.buffer.events.append(opened.popitem()[1][1])
        detach(self)
        self.running = self.tracing = False
        threading.setprofile(None)
        lane.detach(self)
        while self.modes:
            mode = self.modes.pop()
            try:
                mode.__exit__(None, None, None)
            except Exception:
                pass
        while self.undo_patches:
            self.undo_patches.pop()()
        GpuTrace.detach(self)
        ALLOCATOR.forget(self)
        self.buffer.flush()

    def enter_mode(self):
        """Enter a dispatch mode of this tracer on this thread's mode stack."""
        mode = TracingMode(self)
        mode.__enter__()
        self.modes.append(mode)
        return mode

    def _thread_start(self, frame, event, arg):
        """Profile hook run once in each new thread: put the dispatch mode on that thread's mode stack."""
        sys.setprofile(None)
        if self.running:
            TracingMode(self).__enter__()

    def patch_triton(self, triton_module, memory=None) -> None:
        """Once the program imports Triton: each launch of a ``@triton.jit`` kernel is an op on the stream it runs
        on (:mod:`.patches.triton`); ``memory``: the session's live allocations
        (:class:`streamsan.tracers.addresses.LiveMemory`), for its integer arguments (by default this tracer's
        pinned blocks alone)."""
        if self.running:
            if memory is None:
                memory = LiveMemory()
            memory.add_pinned(self.pinned)
            self.undo_patches.append(triton.install(self, triton_module, memory))

    def plan(self, func) -> OpPlan:
        """The plan of an op overload, made at its first dispatch."""
        plan = self.plans.get(id(func))
        if plan is None:
            plan = self.plans[id(func)] = OpPlan(func)
        return plan

    # ------------------------------------------------------------------ agents
    def agent(self, device: int, handle: int) -> int:
        return self.streams.agent(device, handle)

    def name_stream(self, stream, name: str) -> None:
        """Give a stream (torch.cuda.Stream / torch.Stream) a role name for reports."""
        dev, handle = device.stream_key(stream)
        self.streams.name(dev, handle, name)

    def agent_for_handle(self, handle: int) -> int:
        return self.streams.for_handle(handle, device.current)

    # ------------------------------------------------------------------ labels and context
    def label(self, tensor, text: str) -> None:
        r = range_of(self, tensor)
        if r is not None:
            base = r[1] - tensor.storage_offset() * tensor.element_size()
            self.buffer.events.append((E.LABEL, r[0], base, tensor.untyped_storage().nbytes(), text))

    def push_context(self, text: str) -> int:
        """Enter a hooked region: its accesses carry ``text`` as context; in hooks scope, tracing is on inside
        (and PyTorch's GPU trace callbacks get activated at the first region)."""
        prev = self.ctx
        self.ctx = self.buffer.context_id(text)
        if self.scope == "hooks":
            local = self.scope_depth
            depth = getattr(local, "n", 0)
            local.n = depth + 1
            if depth == 0 and self.running:
                GpuTrace.install()
                self.in_scope += 1
                mode = getattr(local, "mode", None)  # one mode per thread, entered again at each region
                if mode is None:
                    mode = local.mode = TracingMode(self)
                mode.__enter__()
                self.modes.append(mode)
        return prev

    def pop_context(self, prev: int) -> None:
        self.ctx = prev
        if self.scope == "hooks":
            local = self.scope_depth
            depth = local.n - 1
            local.n = depth
            mode = getattr(local, "mode", None)
            if depth == 0 and mode is not None and any(m is mode for m in self.modes):
                self.in_scope -= 1
                self.modes.remove(mode)  # this thread's, whichever thread entered a region last
                mode.__exit__(None, None, None)

    # ------------------------------------------------------------------ events
    def emit(self, ev) -> None:
        """Append an event fired outside the dispatch mode's view (a callback, a patched method): inside an op of
        this thread, to the op's own list (:class:`.placement.OpEvents`); else to the buffer. Ops flush the buffer
        when they end; this flushes only when callbacks alone have filled it several times over."""
        cur = self.op_of_this_thread()
        if cur is not None:
            cur[5].append(ev)
            return
        evs = self.buffer.events
        evs.append(ev)
        if len(evs) >= 4 * self.buffer.batch and self.op_agent is None:
            self.buffer.flush()

    def op_of_this_thread(self):
        """The op this thread is dispatching (its ``op_agent`` tuple), or None. ``op_agent`` is the op begun
        last, by any thread; ops of several threads may be under way at once (PyTorch releases the GIL inside
        ops), each in the buffer's ``ops_of_threads``."""
        cur = self.op_agent
        ident = _get_ident()
        if cur is not None and cur[4] == ident:
            return cur
        ops = self.buffer.ops_of_threads
        return ops.get(ident) if ops else None

    # ------------------------------------------------------------------ pinned NumPy views (.pinned_numpy)
    def pinned_range(self, arr):
        """The PINNED range of a NumPy array over a pinned block this tracer knows."""
        if not arr.size:
            return None
        ptr = arr.__array_interface__["data"][0]
        if self.pinned.holds(ptr):
            return strided_range(E.PINNED, ptr, arr.shape, arr.strides, arr.itemsize)
        return None

    def host_op(self, name, reads, writes) -> None:
        """A host access through a pinned NumPy view, when it happens."""
        if self.tracing and self.in_scope and (reads or writes):
            self.emit(host_access(self.staged, name, reads, writes, self.stacks.capture(self.buffer.events, 2),
                                  self.ctx))

    # ------------------------------------------------------------------ notes and internal errors
    def note_once(self, key: str, text: str) -> None:
        """Leave a note for the report, the first time for ``key``: to the session (``on_note``), else as a NOTE
        event."""
        if self.noted.first(key, text):
            if self.on_note is not None:
                self.on_note(text)
            else:
                self.buffer.events.append(warning(text))

    @property
    def stopped_on_bug(self) -> bool:
        """Whether tracing stopped for good after a bug of streamsan's own (:meth:`stop_on_bug`)."""
        return "internal" in self.noted

    def stop_on_bug(self, exc, where: str) -> None:
        """A bug of streamsan's own surfaced at ``where``: stop tracing, log the traceback, say so in the report."""
        import logging

        self.tracing = False
        logging.getLogger("streamsan").error("internal error while tracing %s", where, exc_info=exc)
        self.note_once("internal", f"{E.TRACING_STOPPED} at {where} ({type(exc).__name__}: {exc}); findings "
                                   f"cover what ran before it")
