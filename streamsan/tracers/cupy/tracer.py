"""The CuPy tracer: turns a live CuPy program into streamsan events, in the vocabulary, event buffer, stream
registry and stack table of the torch tracer (a program may use both). What it sees of CuPy, and what it
cannot see, is in docs/cupy.md.

:meth:`CupyTracer.start` installs the patch modules of :mod:`.patches` in order (each ``install(tracer)``
returns the function that undoes it) and :meth:`CupyTracer.stop` undoes them in reverse. While it runs, every
patch routes its calls through it (:mod:`.active`); :meth:`CupyTracer._op` runs one traced call and emits its op
among the events fired inside it. It never synchronizes, waits on events, reads device memory or changes
streams: it reads array metadata, stream handles, ``streamGetFlags`` and ``cudaPointerGetAttributes``.
"""

from __future__ import annotations

import sys
import threading

from ... import events as E
from ...agents import StreamRegistry
from ...imports import when_imported
from ...stacks import StackTable
from ..addresses import DeviceBlocks, LiveMemory
from ..graphs import NODE_CONTEXT, GraphAccesses
from ..notes import Notes, warning
from ..pinned import PinnedBlocks
from ..pinned_numpy import attach, detach, pinned_types
from ..staging import PinnedStaging, host_access, refill_op
from . import active
from .patches import (arrays, copies, device, events, graphs, kernels, memory, namespaces, pinned,
                      runtime_copies, runtime_streams, streams)
from .captures import Captures
from .placement import place
from .ranges import array_address, host_range

# The order in which start() installs the patches (stop() undoes them in reverse).
PATCHES = (streams, events, graphs, device, memory, pinned, arrays, copies, kernels, runtime_streams,
           runtime_copies, namespaces)

MAX_FRESH_STREAMS = 256  # new streams that get a new agent even if their handle was used before (bounds agent ids)


class CupyTracer:
    """Feeds events about the CuPy program into ``buffer`` (a :class:`streamsan.sink.EventBuffer`).

    ``streams`` / ``stacks``: the session's shared stream registry and stack table. ``scope="hooks"`` traces
    operations only inside :meth:`push_context` regions, while still seeing every synchronization and allocation.
    """

    def __init__(self, buffer, streams=None, stacks=None, scope: str = "full", memory=None):
        self.buffer = buffer
        self.scope = scope
        self.streams = streams if streams is not None else StreamRegistry(buffer)
        self.agent_of = self.streams.agent_of
        self.stacks = stacks if stacks is not None else StackTable()
        self.ctx = 0
        self.running = False
        self.saw_cuda = False
        self.noted = Notes()  # the notes left so far, keyed by their text
        self.live = DeviceBlocks()  # the pool blocks allocated while tracing
        self.pinned_blocks = PinnedBlocks()
        # the session's live allocations, for integer kernel arguments that point into one
        self.memory = memory if memory is not None else LiveMemory()
        self.memory.add_device(self.live)
        self.memory.add_pinned(self.pinned_blocks)
        self.staged = PinnedStaging(array_address)  # pinned NumPy arrays' bytes as asynchronous copies read them
        self.captures = Captures()  # CUDA graph captures in progress, by the streams in them
        self.graphs = GraphAccesses()  # each captured graph's accesses, for its launches
        self._tl = threading.local()
        self._undo: list = []  # what stop() calls, the last first: one undo per installed patch module
        self._fresh_streams = 0
        self.cp = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, cupy_module=None) -> None:
        cp = cupy_module if cupy_module is not None else sys.modules.get("cupy")
        if cp is None:
            import cupy as cp  # noqa: F811 (only reached when the program imported it)
        self.cp = cp
        self._rt = cp.cuda.runtime
        self._getDevice = cp.cuda.runtime.getDevice
        self._get_current_stream = cp.cuda.get_current_stream
        self._ndarray = cp.ndarray
        import numpy

        self._numpy = numpy
        self.running = True
        active.tracer = self
        attach(self)
        for patch in PATCHES:
            self._undo.append(patch.install(self))

    def on_import(self, name: str, fn) -> None:
        """Call ``fn(module)`` once module ``name`` is imported (now, if it is), if this tracer still runs then."""
        def run(module):
            if self.running and active.tracer is self:
                fn(module)
        when_imported(name, run)

    def _trouble(self, text: str) -> None:
        self._note_once(f"CuPy tracer: {text}")

    def _note_once(self, text: str) -> None:
        """A warning note in the report, the first time ``text`` is given."""
        if self.noted.first(text, text):
            self._sink().append(warning(text))

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        if active.tracer is self:
            active.tracer = None
        detach(self)
        while self._undo:
            self._undo.pop()()
        self.buffer.flush()

    # ------------------------------------------------------------------ scope and context (library hooks)
    def push_context(self, text: str) -> int:
        prev = self.ctx
        self.ctx = self.buffer.context_id(text)
        self._tl.scoped = getattr(self._tl, "scoped", 0) + 1
        return prev

    def pop_context(self, prev: int) -> None:
        self.ctx = prev
        self._tl.scoped = getattr(self._tl, "scoped", 1) - 1

    def _ops_on(self) -> bool:
        return self.scope == "full" or getattr(self._tl, "scoped", 0) > 0

    # ------------------------------------------------------------------ agents
    def _agent(self, device: int, handle: int, flags=None) -> int:
        a = self.agent_of.get((device, handle))
        if a is None:
            if flags is None and handle > 2:
                flags = self._stream_flags(handle)
            a = self.streams.agent(device, handle, flags)
        return a

    def _stream_flags(self, handle: int):
        try:
            return 0 if self._rt.streamGetFlags(handle) & 1 else E.BLOCKING  # 1 = cudaStreamNonBlocking
        except Exception:
            return None

    def _new_stream(self, dev: int, handle: int, flags) -> None:
        """A stream was just created with this handle. A destroyed stream may have had it, and its work may still
        run: the new stream gets a new agent (up to MAX_FRESH_STREAMS of them; later ones reuse the agent, so a
        race between a destroyed stream's last work and its successor's first work would be missed)."""
        if (dev, handle) in self.agent_of:
            if self._fresh_streams >= MAX_FRESH_STREAMS:
                if self._fresh_streams == MAX_FRESH_STREAMS:
                    self._fresh_streams += 1
                    self._trouble(f"more than {MAX_FRESH_STREAMS} CUDA streams were created and destroyed: "
                                  "streams that reuse a destroyed stream's handle now share its agent")
                return
            self._fresh_streams += 1
            self.streams.forget(dev, handle)
        self._agent(dev, handle, flags)

    def _current(self):
        dev = self._getDevice()
        h = self._get_current_stream().ptr
        return dev, (self.agent_of.get((dev, h)) or self._agent(dev, h))

    def _stream_agent(self, stream):
        """(device, agent) of a CuPy stream object, a raw handle, or None (the current stream)."""
        if stream is None:
            return self._current()
        if isinstance(stream, int):
            dev = self._getDevice()
            return dev, self._agent(dev, int(stream))
        h = getattr(stream, "ptr", None)
        if h is None:
            h = getattr(stream, "cuda_stream", None)  # a torch stream passed by mistake: still a handle
        dev = getattr(stream, "device_id", -1)
        if dev is None or dev < 0:
            dev = self._getDevice()
        return dev, self._agent(dev, int(h))

    def name_stream(self, stream, name: str) -> None:
        dev, a = self._stream_agent(stream)
        self.streams.name(dev, int(stream.ptr), name)

    @staticmethod
    def owns(obj) -> bool:
        """Whether an object (stream, array) is CuPy's (or a pinned NumPy view of ours)."""
        mod = type(obj).__module__ or ""
        return mod.startswith(("cupy", "cupyx", "numpy")) or isinstance(obj, pinned_types())

    def label(self, array, text: str) -> None:
        if isinstance(array, self._ndarray):
            mem = array.data.mem
            if mem.size:
                self._sink().append((E.LABEL, array.data.device_id, int(mem.ptr), int(mem.size), text))
            return
        r = host_range(self, array)
        if r is not None:
            blk = self.pinned_blocks.find(r[1])
            start, size = blk if blk is not None else (r[1], r[2])
            self._sink().append((E.LABEL, E.PINNED, start, size, text))

    # ------------------------------------------------------------------ pinned NumPy arrays (.pinned_numpy)
    def pinned_range(self, arr):
        """The PINNED range of a NumPy array over a pinned block this tracer knows."""
        if not arr.size or self.pinned_blocks.find(array_address(arr)) is None:
            return None
        return host_range(self, arr, known=True)

    def host_op(self, name, reads, writes) -> None:
        """A host access through a pinned NumPy view, when it happens (ignored inside traced CuPy calls)."""
        if not self.running or getattr(self._tl, "depth", 0) or not (reads or writes) or not self._ops_on():
            return
        evs = self.buffer.events
        evs.append(host_access(self.staged, name, reads, writes, self.stacks.capture(evs, 3), self.ctx))

    def _staged_write(self, arr, r, pre) -> None:
        """An asynchronous copy reads ``r`` out of a pinned NumPy array: the host's writes to it that no traced
        call showed since the previous such copy from there (:mod:`streamsan.tracers.staging`), as a host write
        appended to ``pre``."""
        root = arr
        while isinstance(getattr(root, "base", None), self._numpy.ndarray):
            root = root.base
        written = self.staged.check(r, array_address(root), root, arr.itemsize)
        if written is not None:
            pre.append(refill_op(written, self._cur_stack(), self.ctx))

    # ------------------------------------------------------------------ emission
    def _emit(self, ev) -> None:
        self._sink().append(ev)

    def _sink(self) -> list:
        """Where an event goes: inside a traced call of this thread, the call's own list (placed with its op and
        handed to the buffer at once, whatever other threads do meanwhile); else the buffer."""
        inner = getattr(self._tl, "inner", None)
        return inner if inner is not None else self.buffer.events

    def _stack(self, skip=2) -> int:
        if getattr(self._tl, "depth", 0):
            return self._cur_stack()
        return self.stacks.capture(self.buffer.events, skip)

    def _cur_stack(self) -> int:
        """The stack of the traced call in progress, captured on first need (most calls that turn out to be
        views or metadata never pay for it)."""
        tl = self._tl
        s = getattr(tl, "stack", 0)
        if not s:
            s = tl.stack = self.stacks.capture(self.buffer.events, 3)
        return s

    def _op(self, name, fn, args, kwargs, analyze, stream_of=None):
        """Run one traced call and emit its OP (and the events it caused) in order."""
        tl = self._tl
        if getattr(tl, "depth", 0) or not self.running or not self._ops_on():
            return fn(*args, **kwargs)
        buf = self.buffer
        try:
            dev, agent = self._stream_agent(stream_of(args, kwargs) if stream_of is not None else None)
        except Exception as e:
            self._trouble(f"{name}: {type(e).__name__}: {e}")
            return fn(*args, **kwargs)
        tl.depth = 1
        tl.stack = 0
        inner = tl.inner = []  # the events this thread fires inside the call (_sink)
        try:
            try:
                out = fn(*args, **kwargs)
            finally:
                tl.depth = 0
            pre: list = []
            try:
                res = analyze(self, args, kwargs, out, pre)
            except Exception as e:
                self._trouble(f"{name}: {type(e).__name__}: {e}")
                res = None
            if res is not None and self.captures.of and self.captures.call(
                    agent, name, res[0], res[1], self._cur_stack(), self.ctx or self.buffer.context_id(NODE_CONTEXT)):
                res = ((), (), 0, res[3])  # captured into a graph: it does not run now (its allocations are made)
            if pre or (res is not None and (res[0] or res[1] or res[2])):
                place(self, inner, agent, name, res, self._cur_stack(), pre)
        finally:
            tl.inner = None
            tl.stack = 0
            evs = buf.events
            evs.extend(inner)
        if len(evs) >= buf.batch:
            buf.flush()
        return out

    # ------------------------------------------------------------------ events and graphs
    def _event_record(self, event: int, agent: int, stack: int) -> None:
        """``event`` recorded on the stream of ``agent``: now, or as a node of the capture the stream is in."""
        if not self.captures.record(event, agent, stack):
            self._emit((E.EVENT_RECORD, event, agent, stack))

    def _event_wait(self, event: int, agent: int, stack: int) -> None:
        """The stream of ``agent`` waits on ``event``: now, or as a node of a capture (which it may join)."""
        if not self.captures.wait(event, agent, stack):
            self._emit((E.EVENT_WAIT, event, agent, stack))

    def captured_graph(self, graph, cap):
        """The graph a capture gave, wrapped so that its launches are traced."""
        traced = graphs.TracedGraph(graph)
        graphs.ended(self, traced, cap)
        return traced

    # ------------------------------------------------------------------ memory (from the pool's hooks)
    def _on_malloc(self, device_id, ptr, size) -> None:
        if not self.running or not ptr:
            return
        try:
            h = self._get_current_stream().ptr
        except Exception:
            h = 0
        a = self._agent(device_id, h)
        self.live.add(device_id, ptr, size)
        self._sink().append((E.ALLOC, device_id, ptr, size, a, self._stack(3), self.ctx, "", E.FOREIGN_POOL))

    def _on_free(self, device_id, ptr) -> None:
        if not self.live.remove(ptr) or not self.running:
            return
        self._sink().append((E.FREE, device_id, ptr, 0))

    def _on_pinned(self, ptr: int, size: int) -> None:
        if not self.running or not ptr or size <= 0:
            return
        self.pinned_blocks[ptr] = size
        if self.staged.kept:
            self.staged.forget(((E.PINNED, ptr, size),))
        self._sink().append((E.ALLOC, E.PINNED, ptr, size, E.HOST, self._stack(3), self.ctx,
                             f"pinned {size} bytes"))
