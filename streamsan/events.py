"""The event vocabulary: what a tracer tells the analyzer.

An event is a plain tuple whose first item is its kind. Tuples (not objects) keep tracing and replay cheap
and serialise as they are (trace files store them as JSON arrays). This module defines the kinds, the field
order of each, small constructors that document them, and a validator used on untrusted input (trace files).

Agents are small integers chosen by the tracer: ``HOST`` (0) is the host; every CUDA stream gets its own agent
id through a ``STREAM`` event before it is used, keyed by the tracer on (device, stream handle).

Memory is named by *ranges*: ``(space, start, size)`` or ``(space, start, size, layout)``. ``space`` is a device
index (>= 0) for device memory or ``PINNED`` (-1) for page-locked host memory. ``start`` is the address of the
first byte the access may touch and ``size`` the extent in bytes. A strided view adds
``layout = (itemsize, sizes, strides)`` (strides in elements, relative to ``start``): the analyzer uses the
extent for bookkeeping and the layout to confirm that two accesses really touch a common element.

Kinds and fields (``stack`` and ``ctx`` are ids defined earlier by ``DEF_STACK`` / ``DEF_CONTEXT``; 0 = none):

=============  ==========================================================================================
DEF_STACK      (0, stack_id, frames)            frames: [[file, line, function], ...], innermost first
DEF_CONTEXT    (1, ctx_id, text)                e.g. "transformers Cache.prefetch(layer_idx=4)"
STREAM         (2, agent, device, handle, flags, name)   flags: BLOCKING, LEGACY_DEFAULT; name may be ""
EVENT_RECORD   (3, event, agent, stack)         event := clock of the stream (after the enqueue join)
EVENT_WAIT     (4, event, agent, stack)         the stream waits for the event
STREAM_SYNC    (5, agent, stack)                the host waits for the stream (synchronize, query() == True)
EVENT_SYNC     (6, event, stack)                the host waits for the event (synchronize, query() == True)
DEVICE_SYNC    (7, device, stack)               the host waits for every stream of the device
OP             (8, agent, name, reads, writes, stack, ctx, flags)   work on a stream (or a host access when
               agent == HOST); reads / writes: tuples of ranges; flags: OP_BLOCKING (the host waits for
               the stream right after the op: blocking copies, .item(), copies into pageable memory),
               OP_UNRECORDED (the pinned host allocator does not know of the op's accesses: a kernel reading
               pinned memory through a raw pointer; it does not wait for them before handing the block out again)
ALLOC          (9, space, start, size, agent, stack, ctx, what[, pool])   owner stream (HOST for pinned memory);
               what: a short description of the first tensor, e.g. "bfloat16[1, 8, 512, 128]"; pool: the id of
               the private memory pool the block comes from (``torch.cuda.use_mem_pool``), absent or 0 for the
               owner stream's own free lists, ``UNREPORTED_POOL`` for memory of an allocator that reports no
               allocations or frees (the tracer declares each op's new outputs, and their frees when their storage
               dies; see UNREPORTED_POOL), ``FOREIGN_POOL`` for the pool of another library (CuPy's)
FREE           (10, space, start, stack)
RECORD_STREAM  (11, space, start, agent, stack) the block at start is also used by that stream (PyTorch's
               ``record_stream``: no effect on blocks of the FOREIGN_POOL)
LABEL          (12, space, start, size, label)  a human name for memory, e.g. "cache.layers[3].keys"
EVENT_DELETE   (13, event)
NOTE           (14, level, text)                something the tracer could not analyze ("warning", "info")
GRAPH          (15, nodes)                      the nodes of one captured CUDA graph on two or more streams, as
               their capture issued them: OP, EVENT_RECORD and EVENT_WAIT events (the capture's stream order and
               event edges are the graph's dependencies). They are checked against each other only, on clocks of
               their own: a race between them happens inside the graph, at every replay. (Each replay is also an
               OP, ``CUDAGraph.replay``, with all their accesses, in the program's own order.)
RELEASE        (16, space, start, size, stack)  the allocator handed [start, start + size) back to the driver
               (``cudaFree`` of its segments, which waits for the whole device): every access of those bytes
               before it has completed (docs/semantics.md, "Memory handed back to the driver")
=============  ==========================================================================================
"""

from __future__ import annotations

HOST = 0
PINNED = -1
# Agent ids are small integers: a tracer numbers the streams it meets from 1. The analyzer keeps a vector clock of
# every agent per agent (quadratic in the largest id), so a trace naming agent 60000 would make it build billions
# of entries: 2048 streams per process is the limit (past it the analysis stops and the report says so).
MAX_AGENT = 1 << 11
# The name of a host OP a tracer infers rather than sees: the host rewrote pinned bytes outside any traced call
# between two asynchronous copies out of them (streamsan.tracers.staging); reports explain it as such.
UNTRACED_REFILL = "refill outside traced calls"
# The start of the NOTE a tracer leaves when a bug of streamsan's own made it stop tracing: the events after it are
# missing, so a report holding it is incomplete.
TRACING_STOPPED = "streamsan stopped tracing after an internal error"
# The ALLOC pool of memory from a stream-ordered allocator that reports neither allocations nor frees (PyTorch's
# cudaMallocAsync backend: cudaMallocAsync / cudaFreeAsync, the driver's pool; or a program's own allocator, e.g.
# RMM's, through torch.cuda.memory.change_current_allocator). The tracer declares each op's new
# outputs itself, and a FREE when the storage dies. The driver hands freed memory to any stream, ordered after the
# free on the stream it was freed on, and PyTorch frees a block on the stream it was allocated on once its
# record_stream users reach that point; so an allocation is work on its stream, a write of the bytes a declared
# block held, and over a block still live (its free was not seen) it ends that block's life: what its owner and
# recorded users had seen comes before it, other streams' accesses race with it (docs/semantics.md).
UNREPORTED_POOL = -1
# The ALLOC pool of device memory from another library's caching pool that reports its allocations and frees
# (CuPy's): a freed block goes back to that pool's free lists of its stream, and PyTorch's record_stream, which
# only marks blocks of PyTorch's own allocator, does nothing to it (a torch tensor over CuPy memory, by DLPack).
FOREIGN_POOL = -2

DEF_STACK = 0
DEF_CONTEXT = 1
STREAM = 2
EVENT_RECORD = 3
EVENT_WAIT = 4
STREAM_SYNC = 5
EVENT_SYNC = 6
DEVICE_SYNC = 7
OP = 8
ALLOC = 9
FREE = 10
RECORD_STREAM = 11
LABEL = 12
EVENT_DELETE = 13
NOTE = 14
GRAPH = 15
RELEASE = 16

KIND_NAMES = (
    "DEF_STACK", "DEF_CONTEXT", "STREAM", "EVENT_RECORD", "EVENT_WAIT", "STREAM_SYNC", "EVENT_SYNC",
    "DEVICE_SYNC", "OP", "ALLOC", "FREE", "RECORD_STREAM", "LABEL", "EVENT_DELETE", "NOTE", "GRAPH", "RELEASE",
)

# STREAM flags
BLOCKING = 1  # ordered with the legacy default stream in both directions (cudaStreamDefault)
LEGACY_DEFAULT = 2  # the legacy default (NULL) stream of its device

# OP flags
OP_BLOCKING = 1
OP_UNRECORDED = 2


def def_stack(stack_id: int, frames) -> tuple:
    return (DEF_STACK, stack_id, frames)


def def_context(ctx_id: int, text: str) -> tuple:
    return (DEF_CONTEXT, ctx_id, text)


def stream(agent: int, device: int, handle: int, flags: int = 0, name: str = "") -> tuple:
    return (STREAM, agent, device, handle, flags, name)


def event_record(event: int, agent: int, stack: int = 0) -> tuple:
    return (EVENT_RECORD, event, agent, stack)


def event_wait(event: int, agent: int, stack: int = 0) -> tuple:
    return (EVENT_WAIT, event, agent, stack)


def stream_sync(agent: int, stack: int = 0) -> tuple:
    return (STREAM_SYNC, agent, stack)


def event_sync(event: int, stack: int = 0) -> tuple:
    return (EVENT_SYNC, event, stack)


def device_sync(device: int, stack: int = 0) -> tuple:
    return (DEVICE_SYNC, device, stack)


def op(agent: int, name: str, reads=(), writes=(), stack: int = 0, ctx: int = 0, flags: int = 0) -> tuple:
    return (OP, agent, name, tuple(reads), tuple(writes), stack, ctx, flags)


def host_access(name: str, reads=(), writes=(), stack: int = 0, ctx: int = 0) -> tuple:
    return (OP, HOST, name, tuple(reads), tuple(writes), stack, ctx, 0)


def alloc(space: int, start: int, size: int, agent: int, stack: int = 0, ctx: int = 0, what: str = "",
          pool: int = 0) -> tuple:
    ev = (ALLOC, space, start, size, agent, stack, ctx, what)
    return ev + (pool,) if pool else ev


def free(space: int, start: int, stack: int = 0) -> tuple:
    return (FREE, space, start, stack)


def record_stream(space: int, start: int, agent: int, stack: int = 0) -> tuple:
    return (RECORD_STREAM, space, start, agent, stack)


def label(space: int, start: int, size: int, text: str) -> tuple:
    return (LABEL, space, start, size, text)


def release(space: int, start: int, size: int, stack: int = 0) -> tuple:
    return (RELEASE, space, start, size, stack)


def event_delete(event: int) -> tuple:
    return (EVENT_DELETE, event)


def note(level: str, text: str) -> tuple:
    return (NOTE, level, text)


def graph(nodes) -> tuple:
    return (GRAPH, tuple(nodes))


def rng(space: int, start: int, size: int, layout=None) -> tuple:
    """A byte range; ``layout = (itemsize, sizes, strides)`` for a view that is not dense."""
    return (space, start, size) if layout is None else (space, start, size, layout)


class BadEvent(ValueError):
    """An event that does not follow the vocabulary (only raised by :func:`validate`)."""


def _is_int(x) -> bool:
    return type(x) is int


def _check_range(r) -> None:
    if not isinstance(r, (list, tuple)) or len(r) not in (3, 4):
        raise BadEvent("a range is [space, start, size] or [space, start, size, layout]")
    if not (_is_int(r[0]) and _is_int(r[1]) and _is_int(r[2])) or r[0] < PINNED or r[1] < 0 or r[2] < 0:
        raise BadEvent("a range's space, start and size are integers (space >= -1, start and size >= 0)")
    if len(r) == 4 and r[3] is not None:
        lay = r[3]
        if not isinstance(lay, (list, tuple)) or len(lay) != 3 or not _is_int(lay[0]) or lay[0] <= 0:
            raise BadEvent("a layout is [itemsize, sizes, strides]")
        sizes, strides = lay[1], lay[2]
        if (not isinstance(sizes, (list, tuple)) or not isinstance(strides, (list, tuple))
                or len(sizes) != len(strides) or len(sizes) > 64
                or not all(_is_int(s) and s >= 0 for s in sizes)
                or not all(_is_int(s) and s >= 0 for s in strides)):
            raise BadEvent("a layout's sizes and strides are equally long lists of non-negative integers")


# field checkers per kind: a tuple of 'i' (int), 's' (str), 'r' (ranges), 'f' (frames), 'a' (any)
_SHAPES = {
    DEF_STACK: "if",
    DEF_CONTEXT: "is",
    STREAM: "iiiis",
    EVENT_RECORD: "iii",
    EVENT_WAIT: "iii",
    STREAM_SYNC: "ii",
    EVENT_SYNC: "ii",
    DEVICE_SYNC: "ii",
    OP: "isrriii",
    ALLOC: "iiiiiis",
    FREE: "iii",
    RECORD_STREAM: "iiii",
    LABEL: "iiis",
    EVENT_DELETE: "i",
    NOTE: "ss",
    GRAPH: "g",
    RELEASE: "iiii",
}

# the kinds a GRAPH event's nodes may have
GRAPH_NODE_KINDS = (OP, EVENT_RECORD, EVENT_WAIT)


# trailing fields an event may leave out
_OPTIONAL = {ALLOC: "i"}

_AGENT_FIELD = {STREAM: 1, EVENT_RECORD: 2, EVENT_WAIT: 2, STREAM_SYNC: 1, OP: 1, ALLOC: 4, RECORD_STREAM: 3}


def validate(ev) -> tuple:
    """Check one event read from untrusted input and return it as a tuple (ranges as tuples).

    Raises :class:`BadEvent` with a one-line reason.
    """
    if not isinstance(ev, (list, tuple)) or not ev or not _is_int(ev[0]):
        raise BadEvent("an event is an array whose first item is its kind")
    kind = ev[0]
    shape = _SHAPES.get(kind)
    if shape is None:
        raise BadEvent(f"unknown event kind {kind!r}")
    if len(ev) != len(shape) + 1:
        extra = _OPTIONAL.get(kind, "")
        if not extra or len(ev) != len(shape) + len(extra) + 1:
            raise BadEvent(f"{KIND_NAMES[kind]} has {len(shape) + 1} fields, got {len(ev)}")
        shape += extra
    if kind in _AGENT_FIELD and not (0 <= ev[_AGENT_FIELD[kind]] < MAX_AGENT if _is_int(ev[_AGENT_FIELD[kind]])
                                      else False):
        raise BadEvent(f"{KIND_NAMES[kind]}: agent ids are integers in [0, {MAX_AGENT})")
    out = [kind]
    for code, value in zip(shape, ev[1:]):
        if code == "i":
            if not _is_int(value):
                raise BadEvent(f"{KIND_NAMES[kind]}: expected an integer, got {type(value).__name__}")
        elif code == "s":
            if not isinstance(value, str):
                raise BadEvent(f"{KIND_NAMES[kind]}: expected a string, got {type(value).__name__}")
        elif code == "r":
            if not isinstance(value, (list, tuple)):
                raise BadEvent(f"{KIND_NAMES[kind]}: expected a list of ranges")
            for r in value:
                _check_range(r)
            value = tuple((r[0], r[1], r[2]) if len(r) == 3 or r[3] is None
                          else (r[0], r[1], r[2], _layout_tuple(r[3])) for r in value)
        elif code == "g":
            if not isinstance(value, (list, tuple)):
                raise BadEvent("GRAPH: expected a list of nodes")
            nodes = []
            for node in value:
                if not isinstance(node, (list, tuple)) or not node or node[0] not in GRAPH_NODE_KINDS:
                    raise BadEvent("GRAPH nodes are OP, EVENT_RECORD or EVENT_WAIT events")
                nodes.append(validate(node))
            value = tuple(nodes)
        elif code in "fx":
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(f, (list, tuple)) and len(f) == 3 and isinstance(f[0], str) and _is_int(f[1])
                and isinstance(f[2], str) for f in value
            ):
                raise BadEvent("DEF_STACK frames are [file, line, function] triples")
            value = tuple(tuple(f) for f in value)
        out.append(value)
    return tuple(out)


def _layout_tuple(lay):
    return (lay[0], tuple(lay[1]), tuple(lay[2]))
