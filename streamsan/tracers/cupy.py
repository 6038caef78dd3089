"""The CuPy tracer: turns a live CuPy program into streamsan events (the same vocabulary, buffer, stream registry
and stack table as the torch tracer; a program may use both).

CuPy's kernels are launched from Cython (``cupy.cuda.function.Function`` -> ``cuLaunchKernel``), its memory
pool and most of its classes are immutable extension types, and there is no kernel-launch hook. What *can* be
intercepted, and is:

* **Array methods and operators.** Since CuPy 13, ``cupy.ndarray`` is a Python subclass of the Cython
  ``_ndarray_base``, so its methods and operator slots can be overridden. Every array CuPy returns is a
  ``cupy.ndarray``; Cython code that calls ``cpdef`` methods (``get``, ``copy``, ``astype``...) on one also
  dispatches to the override. Read/write sets: the array and array arguments are read; in-place methods and
  operators (``fill``, ``sort``, ``put``, ``__iadd__``..., ``__setitem__``) write the array (``__setitem__`` with
  a basic index writes exactly the indexed view, with an advanced index the whole array); returned arrays whose
  memory is new are written (views are not accesses at all).
* **Namespace functions.** Public functions of ``cupy``, ``cupy.linalg``, ``cupy.fft``, ``cupy.random``,
  ``cupyx`` and ``cupyx.scipy.{ndimage,signal,special,fft,linalg}`` are replaced by wrappers; ufunc objects
  (``cupy.add``...) by transparent proxies (``isinstance(cupy.add, cupy.ufunc)`` still holds) whose
  ``__call__``/``reduce``/``accumulate``/``reduceat``/``outer``/``at`` are traced; ``cupy.matmul`` (a gufunc) by
  patching its class. Rule: array arguments are read, ``out=``/``output=`` and the known in-place functions'
  targets (``copyto``, ``put``, ``place``, ``putmask``, ``fill_diagonal``, ``shuffle``, ``cupyx.scatter_*``) are
  written, new result arrays are written. cuBLAS/cuSOLVER/cuFFT work behind these functions (``matmul``,
  ``dot``, ``@``, ``linalg``, ``fft``) is covered at this level, on the current stream as CuPy uses it.
* **User kernels.** ``cupy.ElementwiseKernel`` / ``ReductionKernel`` / ``RawKernel`` / ``RawModule`` (in ``cupy`` and
  ``cupy._core``) are replaced by transparent subclasses whose ``__call__`` is traced (elementwise/reduction:
  input parameters read, output parameters written; a ``stream=`` argument is honoured). Raw kernels do not say
  what they write: every array (and ``MemoryPointer``) argument is read-and-write unless annotated with
  :func:`cupy_access`. ``RawModule.get_function`` returns a traced proxy of the ``Function``;
  ``cupyx.jit.rawkernel`` kernels are traced by patching their (Python) class.
* **Copies.** ``ndarray.get`` / ``cupy.asnumpy`` (D2H: blocking unless ``blocking=False`` into pinned memory;
  into pageable memory CUDA returns only after the copy), ``ndarray.set`` and ``cupy.asarray``/``array`` from
  NumPy (H2D; a pinned source is read by the stream, a pinned source that NumPy must first convert is read by
  the host), ``cupy.asarray`` of a ``__cuda_array_interface__`` object (CuPy synchronizes the producer's stream
  when the interface names one: modelled), ``copyto`` (D2D), and the raw runtime calls
  ``cupy.cuda.runtime.memcpy/memcpyAsync/memcpy2DAsync/memcpyPeerAsync/memset/memsetAsync`` (spaces from
  ``cudaPointerGetAttributes``, which never synchronizes).
* **Streams and events.** ``Stream``/``Event`` are Python classes: ``Stream.__init__`` declares the stream with
  its real flags (``streamGetFlags``: CuPy streams are *blocking* unless ``non_blocking=True``), ``record``,
  ``wait_event``, ``synchronize``, ``done`` (True = host sync), ``Event.record/synchronize/done``, ``Event``
  deletion; ``cupy.cuda.Device.synchronize`` (through a transparent subclass) and the runtime functions
  ``streamSynchronize``, ``deviceSynchronize``, ``eventRecord``, ``streamWaitEvent``, ``eventSynchronize``,
  ``eventQuery``, ``streamQuery``, ``eventDestroy``, ``streamCreate*``. The current stream is read at call time,
  so ``use()`` and ``with stream:`` need no patch. ``Stream.null`` is the legacy default stream (handle 0, the
  torch default stream too), ``Stream.ptds`` the per-thread default stream (handle 2). Stream agents are keyed by
  (device, handle) in the session's shared registry, so ``torch.cuda.ExternalStream(s.ptr)`` and
  ``cupy.cuda.Stream.from_external(torch_stream)`` are the same agent as the original stream; a newly created
  stream never inherits the agent of a destroyed stream that had the same handle.
* **Memory.** A ``cupy.cuda.MemoryHook`` gives pool mallocs (pointer, rounded size) and frees; the owner is the
  stream current at malloc, which is the arena CuPy's ``MemoryPool`` files the block under (free blocks are reused
  by later allocations on the same stream, exactly the caching-allocator model; CuPy has no ``record_stream``).
  Pinned host blocks: ``cupy.cuda.alloc_pinned_memory`` and ``cupyx.empty_pinned``/``zeros_pinned``/
  ``empty_like_pinned``/``zeros_like_pinned``; other pinned buffers are recognised by
  ``is_memory_pinned`` when they are passed to a copy.
* **Host accesses to pinned memory.** The ``cupyx.*_pinned`` functions return a NumPy subclass view
  (:class:`PinnedArray`, values and memory unchanged) whose ufunc calls (``p.sum()``, ``p + 1``, ``p += 1``),
  NumPy functions (``np.copyto(p, ...)``, ``np.sum(p)``), ``fill``/``sort``/``copy``/``astype``/``item``/
  ``tolist``, reading methods (``argmax``, iteration, ``repr``...) and indexing (``p[i]``, ``p[a:b] = v``) are
  host accesses (:mod:`.pinned_numpy`, shared with the torch tracer).

Blind spots (accesses streamsan cannot see, so races involving them are missed; a missed *synchronization* can
instead cause a false report):

* kernels launched by code that bypasses all of the above: Cython-internal CuPy paths not reached through a
  traced entry point, ``cupy.fuse`` functions, ``cupyx.scipy.sparse`` and other unwrapped modules, kernel objects
  (``RawKernel``/``RawModule``/``ElementwiseKernel``) created before the session started (``streamsan wrap``
  starts before the program imports CuPy, so this only concerns ``watch()``/``enable()`` started late), arrays of
  the CuPy < 13 extension type (nothing on arrays is traced there; a note says so);
* synchronizations done inside Cython without a Python-level call: ``ndarray.device.synchronize()`` on a
  ``Device`` object that CuPy created itself, the count read-backs of ``nonzero``/boolean-mask indexing when they
  do not go through ``ndarray.get``, ``SystemMemory`` / managed-memory host access;
* host accesses to pinned memory through plain NumPy arrays (``numpy.frombuffer(cupy.cuda.alloc_pinned_memory(n))``,
  ``np.asarray(p)``, ``p.view(np.ndarray)``, memoryview/buffer protocol, ``torch.from_numpy``), as they
  happen: writes are found by the bytes they change at the next asynchronous copy out of the same place
  (:mod:`streamsan.tracers.staging`), reads not at all; accesses through unified/managed memory;
* allocations outside the pool hooks (``set_allocator(None)``, ``malloc_async``/``MemoryAsyncPool``, managed
  memory) are accessed but have no lifetime; memory hooks are thread-local: threads started before the session
  are not hooked (threads started after are);
* the pinned memory pool reuses a freed pinned block at once without waiting for copies (unlike torch's pinned
  allocator); the analyzer currently assumes the torch behaviour for every pinned block.

It never synchronizes, waits on events, reads device memory or changes streams (DESIGN §5): it reads array
metadata, stream handles, ``streamGetFlags`` and ``cudaPointerGetAttributes``. Events fired inside a traced call
(its allocations and frees, and the synchronizations/event records of the call) are placed around the call's own
OP event: allocations and frees before it, synchronizations after it (as the torch tracer does).
"""

from __future__ import annotations

import bisect
import functools
import re
import sys
import threading
import types

from .. import events as E
from ..agents import StreamRegistry
from ..stacks import StackTable
from .naming import caller_name
from .pinned_numpy import attach, basic_index, detach, pinned_class, pinned_types, strided_range
from .staging import WRITE_SEEN, PinnedStaging

_active = None  # the running CupyTracer: every patch routes through it (and passes through when None)

MAX_FRESH_STREAMS = 256  # new streams that get a new agent even if their handle was used before (bounds agent ids)

# Events fired inside a traced call that belong before the call's OP (everything else goes after it).
_PRE = frozenset({E.STREAM, E.DEF_STACK, E.DEF_CONTEXT, E.ALLOC, E.FREE, E.LABEL, E.NOTE})

# --------------------------------------------------------------------------------------------- annotations
_ANNOTATIONS: dict = {}  # kernel key -> (reads, writes, ignore) as frozensets of argument positions
_KEEP: list = []  # kernels annotated by identity (kept alive so their ids stay unique)


class _Access:
    __slots__ = ("reads", "writes", "ignore")

    def __init__(self, reads, writes, ignore):
        self.reads = reads
        self.writes = writes
        self.ignore = ignore


def cupy_access(kernel, reads=(), writes=(), ignore=(), *, name=None):
    """Declare which arguments of a raw CUDA kernel it reads and writes (returns ``kernel``).

    ``kernel``: a ``cupy.RawKernel``, a function from ``RawModule.get_function`` (or the ``RawModule`` itself with
    ``name=`` the kernel's name), or a ``cupyx.jit.rawkernel``. ``reads`` / ``writes`` / ``ignore``: argument
    positions (ints, as in the ``args`` tuple of the launch) or parameter names (strs, from the kernel's CUDA
    signature, or the Python signature of a jit kernel). Array arguments not listed stay read-and-write;
    ``ignore`` lists array arguments the kernel does not access at all. Works whether or not a session is active.
    """
    key, names = _kernel_key(kernel, name)
    if key is None:
        raise TypeError(f"cupy_access: not a CuPy raw kernel: {type(kernel).__name__}")

    def positions(items, what):
        if isinstance(items, (str, int)):
            items = (items,)
        out = set()
        for it in items:
            if isinstance(it, bool) or not isinstance(it, (int, str)):
                raise TypeError(f"cupy_access: {what} entries are argument positions or parameter names")
            if isinstance(it, int):
                if it < 0:
                    raise ValueError(f"cupy_access: negative argument position {it}")
                out.add(it)
                continue
            if names is None:
                raise ValueError(f"cupy_access: cannot read the parameter names of this kernel; give positions "
                                 f"instead of {it!r}")
            if it not in names:
                raise ValueError(f"cupy_access: the kernel has no parameter {it!r} (parameters: {names})")
            out.add(names.index(it))
        return frozenset(out)

    r, w, i = positions(reads, "reads"), positions(writes, "writes"), positions(ignore, "ignore")
    _ANNOTATIONS[key] = _Access(r - w - i, w - i, i)
    return kernel


def _kernel_key(kernel, name=None):
    """(annotation key, parameter names or None) of a raw kernel object."""
    key = getattr(kernel, "_streamsan_key", None)
    if key is not None:
        return key, getattr(kernel, "_streamsan_names", None)
    func = getattr(kernel, "_func", None)
    if func is not None and hasattr(kernel, "_mode"):  # cupyx.jit.rawkernel
        return ("jit", id(func)), _py_params(func)
    code = getattr(kernel, "code", None)
    if name is not None:  # a RawModule and a kernel name
        src = code if code is not None else getattr(kernel, "file_path", None)
        return ("mod", src, name), _cuda_params(code, name) if code else None
    kname = getattr(kernel, "name", None)
    if isinstance(code, str) and isinstance(kname, str):  # RawKernel
        return ("raw", code, kname), _cuda_params(code, kname)
    if type(kernel).__name__ == "Function" and hasattr(kernel, "ptr"):  # a Function from an untraced RawModule
        _KEEP.append(kernel)
        return ("fn", id(kernel)), None
    return None, None


def _py_params(func):
    try:
        import inspect

        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None


def _cuda_params(code, name):
    """Parameter names of ``__global__ ... name(...)`` in CUDA source, or None if it cannot be found."""
    if not isinstance(code, str):
        return None
    base = name.split("<")[0].strip().split("::")[-1]
    for m in re.finditer(r"__global__[^;{}]*?\b" + re.escape(base) + r"\s*(?:<[^(]*>)?\s*\(", code):
        i = j = m.end()
        depth = 1
        while j < len(code) and depth:
            c = code[j]
            depth += c == "("
            depth -= c == ")"
            j += 1
        if depth:
            return None
        params = [p.strip() for p in _split_top(code[i:j - 1])]
        if params in ([""], ["void"]):
            return []
        names = []
        for p in params:
            p = p.split("=")[0]
            p = re.sub(r"\[[^\]]*\]", "", p).strip()
            mm = re.search(r"([A-Za-z_]\w*)\s*$", p)
            if mm is None:
                return None
            names.append(mm.group(1))
        return names
    return None


def _split_top(s):
    out, depth, cur = [], 0, []
    for c in s:
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out


def describe(a) -> str:
    return f"{a.dtype}{list(a.shape)}"


def _arg(args, kwargs, pos, name, default=None):
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


# ------------------------------------------------------------------------------------------- the tracer
_NS_DENY = frozenset({
    "get_array_module", "get_default_memory_pool", "get_default_pinned_memory_pool", "show_config",
    "is_available", "fuse", "memoize", "clear_memo", "result_type", "can_cast", "min_scalar_type",
    "promote_types", "common_type", "shape", "ndim", "size", "isscalar", "iscomplexobj", "isrealobj",
    "issubdtype", "issubsctype", "obj2sctype", "sctype2char", "typename", "mintypecode", "may_share_memory",
    "shares_memory", "broadcast_shapes", "binary_repr", "base_repr", "set_printoptions", "get_printoptions",
    "printoptions", "format_float_positional", "format_float_scientific", "get_include", "isfortran",
    "iterable", "empty", "empty_like", "from_dlpack", "fromDlpack", "make_aligned_dtype", "get_runtime_info",
    "seterr", "geterr", "errstate", "allow_synchronize", "get_random_state", "set_random_state", "seed",
    "reset_states", "default_rng", "time", "empty_pinned", "empty_like_pinned", "zeros_pinned",
    "zeros_like_pinned", "asnumpy", "asarray", "array", "asanyarray", "get_plan_cache", "set_plan_cache",
    "show_plan_cache_info", "get_fft_plan",
})
_INPLACE = {
    "copyto": (0,), "put": (0,), "place": (0,), "putmask": (0,), "fill_diagonal": (0,), "shuffle": (0,),
    "scatter_add": (0,), "scatter_max": (0,), "scatter_min": (0,),
}
_OUT_NAMES = ("out", "output")

_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
           "rshift", "divmod")
_ND_GENERIC = tuple(f"__{op}__" for op in _BINARY) + tuple(f"__r{op}__" for op in _BINARY) + (
    "__neg__", "__pos__", "__abs__", "__invert__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__getitem__", "__copy__", "__deepcopy__",
    "all", "any", "argmax", "argmin", "argpartition", "argsort", "astype", "choose", "clip", "compress", "conj",
    "conjugate", "copy", "cumprod", "cumsum", "diagonal", "dot", "flatten", "max", "mean", "min", "nonzero",
    "prod", "ptp", "ravel", "repeat", "reshape", "round", "searchsorted", "squeeze", "std", "sum", "swapaxes",
    "take", "trace", "transpose", "var", "byteswap",
)
_ND_INPLACE = ("fill", "sort", "partition", "put", "scatter_add", "scatter_max", "scatter_min") + tuple(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
                            "lshift", "rshift", "div"))
_ND_D2H = ("item", "tolist", "tobytes", "tofile", "__int__", "__float__", "__complex__", "__bool__", "__index__")
_NS_MODULES = ("cupy.linalg", "cupy.fft", "cupy.random", "cupyx", "cupyx.scipy.ndimage", "cupyx.scipy.signal",
               "cupyx.scipy.special", "cupyx.scipy.fft", "cupyx.scipy.linalg")


def _kw_stream(args, kwargs):
    return kwargs.get("stream")


class CupyTracer:
    """Feeds events about the CuPy program into ``buffer`` (a :class:`streamsan.sink.EventBuffer`).

    ``streams`` / ``stacks``: the session's shared stream registry and stack table. ``scope="hooks"`` traces
    operations only inside :meth:`push_context` regions, while still seeing every synchronization and allocation.
    """

    def __init__(self, buffer, streams=None, stacks=None, scope: str = "full"):
        self.buffer = buffer
        self.scope = scope
        self.streams = streams if streams is not None else StreamRegistry(buffer)
        self.agent_of = self.streams.agent_of
        self.stacks = stacks if stacks is not None else StackTable()
        self.ctx = 0
        self.running = False
        self.saw_cuda = False
        self.problems: list[str] = []
        self.live: dict = {}  # (device, ptr) -> size of pool blocks allocated while tracing
        self._pin_starts: list[int] = []
        self._pin_sizes: dict[int, int] = {}
        self.staged = PinnedStaging(_np_data)  # pinned NumPy arrays' bytes as asynchronous copies read them
        self.capturing: set[int] = set()  # agents of streams capturing a CUDA graph
        self._tl = threading.local()
        self._patched: list = []
        self._hooks: list = []
        self._prev_profile = None
        self._profile = None
        self._ns_done: set = set()
        self._fresh_streams = 0
        self.cp = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, cupy_module=None) -> None:
        global _active
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
        _active = self
        attach(self)
        for step in (self._patch_streams, self._patch_memory, self._patch_ndarray, self._patch_kernels,
                     self._patch_runtime, self._patch_cupy_namespace):
            self._guard(step, cp)
        from ..imports import when_imported

        for mod in _NS_MODULES:
            when_imported(mod, self._when(self._patch_namespace_module))
        when_imported("cupyx", self._when(self._patch_cupyx))
        when_imported("cupyx.jit", self._when(self._patch_jit))

    def _when(self, fn):
        def run(module):
            if self.running and _active is self:
                self._guard(fn, module)
        return run

    def _guard(self, fn, arg):
        try:
            fn(arg)
        except Exception as e:  # a CuPy version we do not know: trace less, never break the program
            self._trouble(f"{fn.__name__}: {type(e).__name__}: {e}")

    def _trouble(self, text: str) -> None:
        self._note_once(f"CuPy tracer: {text}")

    def _note_once(self, msg: str) -> None:
        if msg not in self.problems:
            self.problems.append(msg)
            self._sink().append((E.NOTE, "warning", msg))

    def stop(self) -> None:
        global _active
        if not self.running:
            return
        self.running = False
        if _active is self:
            _active = None
        detach(self)
        while self._patched:
            obj, attr, orig, had = self._patched.pop()
            try:
                if had:
                    setattr(obj, attr, orig)
                else:
                    delattr(obj, attr)
            except Exception:
                pass
        for hook in self._hooks:
            try:
                hook.__exit__(None, None, None)
            except Exception:
                pass
        self._hooks = []
        if self._profile is not None and _threading_getprofile() is self._profile:
            threading.setprofile(self._prev_profile)
        self.buffer.flush()

    def _set(self, obj, attr, value) -> None:
        had = attr in vars(obj) if isinstance(obj, type) else hasattr(obj, attr)
        orig = vars(obj).get(attr) if isinstance(obj, type) else getattr(obj, attr, None)
        setattr(obj, attr, value)
        self._patched.append((obj, attr, orig, had))

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
        r = self._np_range(array)
        if r is not None:
            blk = self._pin_find(r[1])
            start, size = blk if blk is not None else (r[1], r[2])
            self._sink().append((E.LABEL, E.PINNED, start, size, text))

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
            if self.capturing and agent in self.capturing:
                res = None  # captured into a graph: it does not run now
            if pre or (res is not None and (res[0] or res[1] or res[2])):
                self._place(inner, agent, name, res, self._cur_stack(), pre)
        finally:
            tl.inner = None
            tl.stack = 0
            evs = buf.events
            evs.extend(inner)
        if len(evs) >= buf.batch:
            buf.flush()
        return out

    def _place(self, evs, agent, name, res, stack, pre) -> None:
        """Put a call's op among the events its thread fired inside it (``evs``, the call's own list):
        allocations, frees and declarations first, then ``pre`` (e.g. an inferred host write), the op, the rest."""
        op = None
        fresh = None
        if res is not None:
            reads, writes, flags, fresh = res
            if reads or writes or flags:
                op = (E.OP, agent, name, tuple(reads), tuple(writes), stack, self.ctx, flags)
                self.saw_cuda = True
                if writes and self.staged.kept:
                    self.staged.forget(writes)
        inner = evs[:]
        del evs[:]
        after = []
        for ev in inner:
            if ev[0] in _PRE:
                if fresh and ev[0] == E.ALLOC and not ev[7] and ev[2] in fresh:
                    ev = ev[:7] + (fresh[ev[2]],) + ev[8:]  # (the description; the pool stays)
                evs.append(ev)
            else:
                after.append(ev)
        evs.extend(pre)
        if op is not None:
            evs.append(op)
        evs.extend(after)

    def host_op(self, name, reads, writes) -> None:
        """A host access to pinned memory through a :mod:`.pinned_numpy` view (ignored inside traced CuPy
        calls)."""
        if not self.running or getattr(self._tl, "depth", 0) or not (reads or writes) or not self._ops_on():
            return
        evs = self.buffer.events
        stack = self.stacks.capture(evs, 3)
        if writes and self.staged.kept:
            self.staged.forget(writes)
        evs.append((E.OP, E.HOST, name, tuple(reads), tuple(writes), stack, self.ctx, 0))

    # ------------------------------------------------------------------ ranges
    def _range(self, a):
        """Device range of a cupy.ndarray (None when empty)."""
        if a.size == 0:
            return None
        data = a.data
        if a._c_contiguous or a._f_contiguous:
            return (data.device_id, data.ptr, a.nbytes)
        return strided_range(data.device_id, data.ptr, a.shape, a.strides, a.itemsize)

    def _pin_register(self, ptr: int, size: int) -> None:
        if ptr not in self._pin_sizes:
            bisect.insort(self._pin_starts, ptr)
        self._pin_sizes[ptr] = size

    def _pin_find(self, ptr: int):
        i = bisect.bisect_right(self._pin_starts, ptr) - 1
        if i >= 0:
            s = self._pin_starts[i]
            if ptr < s + self._pin_sizes[s]:
                return s, self._pin_sizes[s]
        return None

    def pinned_range(self, arr):
        """The PINNED range of a NumPy array over pinned memory this tracer knows (:mod:`.pinned_numpy`)."""
        if not arr.size or self._pin_find(arr.__array_interface__["data"][0]) is None:
            return None
        return self._np_range(arr, known=True)

    def _np_range(self, arr, query=False, known=False):
        """PINNED range of a NumPy array if its memory is pinned (registered, or asked with ``query``)."""
        if arr.size == 0:
            return None
        ptr = arr.__array_interface__["data"][0]
        if not known and self._pin_find(ptr) is None:
            if not query:
                return None
            try:
                from cupy.cuda import pinned_memory

                pinned = pinned_memory.is_memory_pinned(ptr)
            except Exception:
                pinned = False
            if not pinned:
                return None
            base = arr
            while isinstance(getattr(base, "base", None), self._numpy.ndarray):
                base = base.base
            bptr = base.__array_interface__["data"][0]
            self._pin_register(bptr, base.nbytes)
            self._sink().append((E.ALLOC, E.PINNED, bptr, base.nbytes, E.HOST, 0, self.ctx,
                                 f"pinned {describe(base)}"))
        return strided_range(E.PINNED, ptr, arr.shape, arr.strides, arr.itemsize)

    def _ptr_space(self, ptr: int):
        """Space of a raw pointer: a device index, PINNED, or None (pageable host memory / unknown)."""
        if self._pin_find(ptr) is not None:
            return E.PINNED
        try:
            attrs = self._rt.pointerGetAttributes(ptr)
        except Exception:
            return None
        t = getattr(attrs, "type", 0)
        if t == 1:
            return E.PINNED
        if t in (2, 3):
            return int(attrs.device)
        return None

    # ------------------------------------------------------------------ analyses (args, kwargs, out, pre)
    def _generic(self, args, kwargs, out, inplace=()):
        """Array arguments read, in-place targets and ``out=`` written, new result arrays written; None for a
        call that only made views of its arguments."""
        if out is NotImplemented:
            return None
        nd = self._ndarray
        np_nd = self._numpy.ndarray
        written = set()
        for pos in inplace:
            v = args[pos] if pos < len(args) else None
            if isinstance(v, nd):
                written.add(id(v))
        for k in _OUT_NAMES:
            o = kwargs.get(k)
            if o is not None:
                for v in (o if isinstance(o, (tuple, list)) else (o,)):
                    if isinstance(v, nd):
                        written.add(id(v))
        arrays = []
        hosts = []
        for v in (*args, *kwargs.values()):
            for x in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(x, nd):
                    arrays.append(x)
                elif isinstance(x, np_nd):
                    hosts.append(x)
        mems = {id(a.data.mem) for a in arrays}
        results = [out] if isinstance(out, nd) else (
            [x for x in out if isinstance(x, nd)] if isinstance(out, (tuple, list)) else [])
        fresh_arrays = [r for r in results if id(r.data.mem) not in mems
                        and type(r.data.mem).__name__ not in ("UnownedMemory", "DLPackMemory")]
        if results and not fresh_arrays and not written:
            return None  # views of the arguments: metadata only
        rng = self._range
        reads, writes = [], []
        for a in arrays:
            r = rng(a)
            if r is not None:
                (writes if id(a) in written else reads).append(r)
        for h in hosts:
            r = self._np_range(h)
            if r is not None:
                reads.append(r)
        fresh = {}
        for a in fresh_arrays:
            r = rng(a)
            if r is not None:
                writes.append(r)
                fresh[a.data.mem.ptr] = describe(a)
        return reads, writes, 0, fresh

    def _setitem(self, args, kwargs, out, pre):
        a, key, value = args[0], args[1], args[2]
        nd = self._ndarray
        reads = []
        if basic_index(key):
            target = self._range(_ndarray_base(nd).__getitem__(a, key))
        else:
            target = self._range(a)
            for k in (key if isinstance(key, tuple) else (key,)):
                if isinstance(k, nd):
                    r = self._range(k)
                    if r is not None:
                        reads.append(r)
        if isinstance(value, nd):
            r = self._range(value)
            if r is not None:
                reads.append(r)
        elif isinstance(value, self._numpy.ndarray):
            r = self._np_range(value)
            if r is not None:
                reads.append(r)
        return reads, [target] if target is not None else [], 0, None

    def _staged_write(self, arr, r, pre) -> None:
        """An asynchronous copy reads ``r`` out of a pinned NumPy array: the host's writes to it that no traced
        call showed since the previous such copy from there (:mod:`streamsan.tracers.staging`), as a host write."""
        root = arr
        while isinstance(getattr(root, "base", None), self._numpy.ndarray):
            root = root.base
        written = self.staged.check(r, _np_data(root), root, arr.itemsize)
        if written is not None:
            pre.append((E.OP, E.HOST, WRITE_SEEN, (), (written,), self._cur_stack(), self.ctx, 0))

    def _d2h(self, args, kwargs, out, pre):
        """ndarray.get(stream, order, out, blocking) and cupy.asnumpy(a, stream, order, out, blocking=)."""
        a = args[0]
        if not isinstance(a, self._ndarray):
            return None
        host = _arg(args, kwargs, 3, "out")
        blocking = _arg(args, kwargs, 4, "blocking", True)
        r = self._range(a)
        writes = []
        pinned = False
        if host is not None:
            w = self._np_range(host, query=True)
            if w is not None:
                writes.append(w)
                pinned = True
        flags = E.OP_BLOCKING if (blocking or not pinned) else 0
        return [r] if r is not None else [], writes, flags, None

    def _d2h_value(self, args, kwargs, out, pre):
        """item(), tolist(), int(a)...: a blocking read on the current stream."""
        r = self._range(args[0])
        return [r] if r is not None else [], [], E.OP_BLOCKING, None

    def _set_h2d(self, args, kwargs, out, pre):
        """ndarray.set(arr, stream): H2D; a pinned source is read by the stream."""
        a, host = args[0], _arg(args, kwargs, 1, "arr")
        w = self._range(a)
        reads = []
        if isinstance(host, self._numpy.ndarray):
            r = self._np_range(host, query=True)
            if r is not None:
                reads.append(r)
                self._staged_write(host, r, pre)
        return reads, [w] if w is not None else [], 0, None

    def _asarray(self, args, kwargs, out, pre):
        obj = _arg(args, kwargs, 0, "obj", _arg(args, kwargs, 0, "a"))
        nd = self._ndarray
        if isinstance(obj, nd) or not isinstance(out, nd):
            return self._generic(args, kwargs, out)
        reads = []
        flags = E.OP_BLOCKING if kwargs.get("blocking") else 0
        np_ = self._numpy
        if isinstance(obj, np_.ndarray):
            r = self._np_range(obj, query=True)
            if r is not None:
                dtype = _arg(args, kwargs, 1, "dtype")
                converted = (obj.ndim == 0 or (dtype is not None and np_.dtype(dtype) != obj.dtype)
                             or not (obj.flags.c_contiguous or obj.flags.f_contiguous)
                             or obj.dtype.byteorder == ">")
                if converted:  # NumPy converts it on the host first; the copy reads the converted array
                    pre.append((E.OP, E.HOST, "numpy.array", (r,), (), self._cur_stack(), self.ctx, 0))
                else:
                    reads.append(r)
                    if not flags:
                        self._staged_write(obj, r, pre)
        elif hasattr(obj, "__cuda_array_interface__"):
            try:
                iface = obj.__cuda_array_interface__
            except Exception:
                iface = None
            if iface:
                sp = iface.get("stream")
                if sp is not None and getattr(sys.modules.get("cupy._util"), "CUDA_ARRAY_INTERFACE_SYNC", True):
                    dev = out.data.device_id
                    pre.append((E.STREAM_SYNC, self._agent(dev, int(sp)), self._cur_stack()))
                mem = out.data.mem
                if type(mem).__name__ == "UnownedMemory":
                    return None  # zero-copy
                ptr = iface["data"][0]
                dt = np_.dtype(iface["typestr"])
                shape = tuple(iface["shape"])
                strides = iface.get("strides") or _c_strides(shape, dt.itemsize)
                r = strided_range(out.data.device_id, ptr, shape, strides, dt.itemsize)
                if r is not None:
                    reads.append(r)
        mem = out.data.mem
        if type(mem).__name__ in ("UnownedMemory", "DLPackMemory"):
            return None
        w = self._range(out)
        return reads, [w] if w is not None else [], flags, {mem.ptr: describe(out)}

    def _raw(self, key, kargs):
        """Reads/writes of a raw kernel launch: array/MemoryPointer arguments, per the annotation."""
        ann = _ANNOTATIONS.get(key)
        nd = self._ndarray
        reads, writes = [], []
        mp_type = getattr(self.cp.cuda, "MemoryPointer", ())
        for i, v in enumerate(kargs):
            if isinstance(v, nd):
                r = self._range(v)
            elif isinstance(v, mp_type):
                mem = v.mem
                end = int(mem.ptr) + int(mem.size)
                r = (v.device_id, int(v.ptr), end - int(v.ptr)) if end > int(v.ptr) else None
            else:
                continue
            if r is None:
                continue
            if ann is None:
                writes.append(r)
            elif i in ann.ignore:
                continue
            elif i in ann.reads:
                reads.append(r)
            else:
                writes.append(r)
        return reads, writes, 0, None

    # ------------------------------------------------------------------ memory
    def _on_malloc(self, device_id, ptr, size) -> None:
        if not self.running or not ptr:
            return
        try:
            h = self._get_current_stream().ptr
        except Exception:
            h = 0
        a = self._agent(device_id, h)
        self.live[(device_id, ptr)] = size
        self._sink().append((E.ALLOC, device_id, ptr, size, a, self._stack(3), self.ctx, "", E.FOREIGN_POOL))

    def _on_free(self, device_id, ptr) -> None:
        if self.live.pop((device_id, ptr), None) is None or not self.running:
            return
        self._sink().append((E.FREE, device_id, ptr, 0))

    def _on_pinned(self, ptr: int, size: int) -> None:
        if not self.running or not ptr or size <= 0:
            return
        self._pin_register(ptr, size)
        if self.staged.kept:
            self.staged.forget(((E.PINNED, ptr, size),))
        self._sink().append((E.ALLOC, E.PINNED, ptr, size, E.HOST, self._stack(3), self.ctx,
                             f"pinned {size} bytes"))

    def _enter_hook_here(self) -> None:
        hook = _make_hook(self.cp, self)
        hook.__enter__()
        self._hooks.append(hook)

    # ------------------------------------------------------------------ patches: streams and events
    def _patch_streams(self, cp) -> None:
        S = cp.cuda.stream
        Base, Stream, Event = S._BaseStream, S.Stream, S.Event
        t = self
        ev = self._emit

        def wrap(cls, attr, make):
            orig = vars(cls)[attr]
            self._set(cls, attr, make(orig))

        def m_sync(orig):
            def synchronize(s):
                r = orig(s)
                if t.running:
                    dev, a = t._stream_agent(s)
                    ev((E.STREAM_SYNC, a, t._stack()))
                return r
            return functools.wraps(orig)(synchronize)

        def m_record(orig):
            def record(s, event=None):
                e = orig(s, event)
                if t.running:
                    dev, a = t._stream_agent(s)
                    if a not in t.capturing:  # else a node of the graph
                        ev((E.EVENT_RECORD, int(e.ptr), a, t._stack()))
                return e
            return functools.wraps(orig)(record)

        def m_wait(orig):
            def wait_event(s, event):
                r = orig(s, event)
                if t.running:
                    dev, a = t._stream_agent(s)
                    if a not in t.capturing:
                        ev((E.EVENT_WAIT, int(event.ptr), a, t._stack()))
                return r
            return functools.wraps(orig)(wait_event)

        def m_begin(orig):
            def begin_capture(s, *args, **kwargs):
                r = orig(s, *args, **kwargs)
                if t.running:
                    t._note_once(GRAPH_NOTE)
                    t.capturing.add(t._stream_agent(s)[1])
                return r
            return functools.wraps(orig)(begin_capture)

        def m_end(orig):
            def end_capture(s, *args, **kwargs):
                try:
                    return orig(s, *args, **kwargs)
                finally:
                    if t.running:
                        t.capturing.discard(t._stream_agent(s)[1])
            return functools.wraps(orig)(end_capture)

        def m_sdone(orig):
            def done(s):
                d = orig.fget(s)
                if d and t.running:
                    dev, a = t._stream_agent(s)
                    ev((E.STREAM_SYNC, a, t._stack()))
                return d
            return property(done, doc=orig.__doc__)

        def m_init(orig):
            def __init__(s, *args, **kwargs):
                orig(s, *args, **kwargs)
                if t.running:
                    h = int(s.ptr)
                    if h > 2:  # a new CUDA stream: a new agent, even if a destroyed stream had its handle
                        dev = s.device_id if s.device_id >= 0 else t._getDevice()
                        t._new_stream(dev, h, None)
                        name = caller_name()
                        if name:
                            t.streams.name_created(dev, h, name)
            return functools.wraps(orig)(__init__)

        def m_erecord(orig):
            def record(e, stream=None):
                r = orig(e, stream)
                if t.running:
                    dev, a = t._stream_agent(stream)
                    if a not in t.capturing:
                        ev((E.EVENT_RECORD, int(e.ptr), a, t._stack()))
                return r
            return functools.wraps(orig)(record)

        def m_esync(orig):
            def synchronize(e):
                r = orig(e)
                if t.running:
                    ev((E.EVENT_SYNC, int(e.ptr), t._stack()))
                return r
            return functools.wraps(orig)(synchronize)

        def m_edone(orig):
            def done(e):
                d = orig.fget(e)
                if d and t.running:
                    ev((E.EVENT_SYNC, int(e.ptr), t._stack()))
                return d
            return property(done, doc=orig.__doc__)

        def m_edel(orig):
            def __del__(e, *args, **kwargs):
                if t.running and getattr(e, "ptr", 0):
                    ev((E.EVENT_DELETE, int(e.ptr)))
                return orig(e, *args, **kwargs)
            return __del__

        wrap(Base, "synchronize", m_sync)
        wrap(Base, "record", m_record)
        wrap(Base, "wait_event", m_wait)
        wrap(Base, "done", m_sdone)
        wrap(Stream, "__init__", m_init)
        wrap(Event, "record", m_erecord)
        wrap(Event, "synchronize", m_esync)
        wrap(Event, "done", m_edone)
        if "__del__" in vars(Event):
            wrap(Event, "__del__", m_edel)
        for cls in (Base, Stream):
            for attr, make in (("begin_capture", m_begin), ("end_capture", m_end)):
                if attr in vars(cls):
                    wrap(cls, attr, make)

        # cupy.cuda.Device.synchronize: Device is an extension type; a transparent subclass replaces the name.
        Device = cp.cuda.Device

        def dsync(d):
            Device.synchronize(d)
            tr = _active
            if tr is not None:
                tr._emit((E.DEVICE_SYNC, int(d.id), tr._stack()))

        TD = _transparent_subclass(Device, "Device", {"synchronize": dsync})
        self._set(cp.cuda, "Device", TD)
        if getattr(cp.cuda, "device", None) is not None and getattr(cp.cuda.device, "Device", None) is Device:
            self._set(cp.cuda.device, "Device", TD)

    def _patch_runtime(self, cp) -> None:
        rt = cp.cuda.runtime
        t = self
        ev = self._emit

        def sync_fn(orig, make):
            @functools.wraps(orig)
            def f(*args, **kwargs):
                r = orig(*args, **kwargs)
                if t.running:
                    try:
                        e = make(r, *args, *kwargs.values())
                    except Exception as exc:
                        t._trouble(f"{orig.__name__}: {type(exc).__name__}: {exc}")
                        e = None
                    if e is not None:
                        ev(e)
                return r
            return f

        def agent(h):
            return t._stream_agent(int(h))[1]

        simple = {
            "streamSynchronize": lambda r, s: (E.STREAM_SYNC, agent(s), t._stack(3)),
            "deviceSynchronize": lambda r: (E.DEVICE_SYNC, t._getDevice(), t._stack(3)),
            "eventSynchronize": lambda r, e: (E.EVENT_SYNC, int(e), t._stack(3)),
            "eventRecord": lambda r, e, s: (E.EVENT_RECORD, int(e), agent(s), t._stack(3)),
            "streamWaitEvent": lambda r, s, e, *f: (E.EVENT_WAIT, int(e), agent(s), t._stack(3)),
            "eventQuery": lambda r, e: (E.EVENT_SYNC, int(e), t._stack(3)) if r == 0 else None,
            "streamQuery": lambda r, s: (E.STREAM_SYNC, agent(s), t._stack(3)) if r == 0 else None,
            "eventDestroy": lambda r, e: (E.EVENT_DELETE, int(e)),
        }
        for name, make in simple.items():
            orig = getattr(rt, name, None)
            if orig is not None:
                self._set(rt, name, sync_fn(orig, make))

        def creator(orig, flags_of):
            @functools.wraps(orig)
            def f(*args):
                h = orig(*args)
                if t.running and int(h) > 2:
                    t._new_stream(t._getDevice(), int(h), flags_of(args))
                return h
            return f

        for name, flags_of in (("streamCreate", lambda a: E.BLOCKING),
                               ("streamCreateWithFlags", lambda a: 0 if (a[0] if a else 0) & 1 else E.BLOCKING),
                               ("streamCreateWithPriority", lambda a: 0 if (a[0] if a else 0) & 1 else E.BLOCKING)):
            orig = getattr(rt, name, None)
            if orig is not None:
                self._set(rt, name, creator(orig, flags_of))

        # copies and memsets: (name, stream position or None for the legacy stream, analysis)
        def copy_an(dst_i, src_i, size_fn, legacy_sync=False):
            def an(tr, args, kwargs, out, pre):
                dst, src = int(args[dst_i]), int(args[src_i])
                size = size_fn(args)
                ds, ss = tr._ptr_space(dst), tr._ptr_space(src)
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

        def memset_an(tr, args, kwargs, out, pre):
            ptr, size = int(args[0]), int(args[2])
            sp = tr._ptr_space(ptr)
            return [], [(sp, ptr, size)] if sp is not None and size > 0 else [], 0, None

        def memcpy2d_an(tr, args, kwargs, out, pre):
            dst, dpitch, src, spitch, width, height = (int(x) for x in args[:6])
            ds, ss = tr._ptr_space(dst), tr._ptr_space(src)
            reads = [_pitched(ss, src, spitch, width, height)] if ss is not None else []
            writes = [_pitched(ds, dst, dpitch, width, height)] if ds is not None else []
            flags = E.OP_BLOCKING if ds is None and ss is not None and ss >= 0 else 0
            return [r for r in reads if r], [w for w in writes if w], flags, None

        def peer_an(tr, args, kwargs, out, pre):
            dst, ddev, src, sdev, size = int(args[0]), int(args[1]), int(args[2]), int(args[3]), int(args[4])
            if size <= 0:
                return None
            return [(sdev, src, size)], [(ddev, dst, size)], 0, None

        legacy = lambda args, kwargs: 0  # noqa: E731 (cudaMemcpy/cudaMemset: the legacy default stream)
        specs = (
            ("memcpyAsync", lambda a, k: int(a[4]) if len(a) > 4 else k.get("stream", 0),
             copy_an(0, 1, lambda a: int(a[2]))),
            ("memcpy", legacy, copy_an(0, 1, lambda a: int(a[2]), legacy_sync=True)),
            ("memsetAsync", lambda a, k: int(a[3]) if len(a) > 3 else k.get("stream", 0), memset_an),
            ("memset", legacy, memset_an),
            ("memcpy2DAsync", lambda a, k: int(a[7]) if len(a) > 7 else k.get("stream", 0), memcpy2d_an),
            ("memcpyPeerAsync", lambda a, k: int(a[5]) if len(a) > 5 else k.get("stream", 0), peer_an),
        )
        for name, stream_of, an in specs:
            orig = getattr(rt, name, None)
            if orig is not None:
                self._set(rt, name, _traced_function(orig, "cupy.cuda.runtime." + name, an, stream_of))

    # ------------------------------------------------------------------ patches: memory
    def _patch_memory(self, cp) -> None:
        self._enter_hook_here()
        prev = _threading_getprofile()
        t = self

        def thread_start(frame, event, arg):
            sys.setprofile(None)
            if t.running:
                try:
                    t._enter_hook_here()
                except Exception:
                    pass
            if prev is not None:
                prev(frame, event, arg)

        self._prev_profile = prev
        self._profile = thread_start
        threading.setprofile(thread_start)

        orig = cp.cuda.alloc_pinned_memory

        @functools.wraps(orig)
        def alloc_pinned_memory(size):
            mem = orig(size)
            tr = _active
            if tr is not None:
                tr._on_pinned(int(mem.ptr), int(size))
            return mem

        self._set(cp.cuda, "alloc_pinned_memory", alloc_pinned_memory)
        pm = getattr(cp.cuda, "pinned_memory", None)
        if pm is not None and getattr(pm, "alloc_pinned_memory", None) is orig:
            self._set(pm, "alloc_pinned_memory", alloc_pinned_memory)

    # ------------------------------------------------------------------ patches: arrays
    def _patch_ndarray(self, cp) -> None:
        nd = cp.ndarray
        if not (nd.__flags__ & (1 << 9)):  # Py_TPFLAGS_HEAPTYPE: CuPy >= 13 makes it a Python subclass
            self._trouble(f"cupy {cp.__version__}: cupy.ndarray is an extension type (CuPy < 13), so array "
                          "methods and operators are not traced; only streams, events, copies, kernels and "
                          "allocations are")
            return
        base = nd.__mro__[1]

        def install(attr, analyze, stream_of=None, name=None):
            fn = getattr(base, attr, None)
            if fn is None or attr in vars(nd):
                return
            self._set(nd, attr, _traced_method(fn, name or "cupy.ndarray." + attr, analyze, stream_of))

        gen = _an_generic(())
        for attr in _ND_GENERIC:
            install(attr, gen)
        inpl = _an_generic((0,))
        for attr in _ND_INPLACE:
            install(attr, inpl)
        for attr in _ND_D2H:
            install(attr, _an_d2h_value)
        install("__setitem__", _an_setitem)
        install("get", _an_d2h, lambda a, k: _arg(a, k, 1, "stream"))
        install("set", _an_set, lambda a, k: _arg(a, k, 2, "stream"))

    # ------------------------------------------------------------------ patches: kernels
    def _patch_kernels(self, cp) -> None:
        core = getattr(cp, "_core", None)
        EK, RK, RawK, RawM = cp.ElementwiseKernel, cp.ReductionKernel, cp.RawKernel, cp.RawModule

        def ek_call(k, *args, **kwargs):
            tr = _active
            if tr is None:
                return EK.__call__(k, *args, **kwargs)
            nin, nargs = k.nin, k.nargs
            return tr._op("cupy.ElementwiseKernel:" + k.name, functools.partial(EK.__call__, k), args, kwargs,
                          _an_generic(range(nin, nargs)), _kw_stream)

        def rk_call(k, *args, **kwargs):
            tr = _active
            if tr is None:
                return RK.__call__(k, *args, **kwargs)
            return tr._op("cupy.ReductionKernel:" + k.name, functools.partial(RK.__call__, k), args, kwargs,
                          _an_generic(range(k.nin, max(len(args), k.nin))), _kw_stream)

        def raw_call(k, grid, block, args, **kwargs):
            tr = _active
            if tr is None:
                return RawK.__call__(k, grid, block, args, **kwargs)
            key = ("raw", k.code, k.name)
            return tr._op("cupy.RawKernel:" + k.name, functools.partial(RawK.__call__, k), (grid, block, args),
                          kwargs, lambda t, a, kw, o, pre: t._raw(key, a[2]), _kw_stream)

        def get_function(m, name):
            fn = RawM.get_function(m, name)
            src = m.code if m.code is not None else getattr(m, "file_path", None)
            return _TracedFunction(fn, ("mod", src, name), _cuda_params(m.code, name) if m.code else None, name)

        classes = (
            ("ElementwiseKernel", EK, {"__call__": ek_call}),
            ("ReductionKernel", RK, {"__call__": rk_call}),
            ("RawKernel", RawK, {"__call__": raw_call}),
            ("RawModule", RawM, {"get_function": get_function}),
        )
        for name, cls, body in classes:
            sub = _transparent_subclass(cls, name, body)
            self._set(cp, name, sub)
            if core is not None and getattr(core, name, None) is cls:
                self._set(core, name, sub)

        gufuncs = sys.modules.get("cupy._core._gufuncs")
        G = getattr(gufuncs, "_GUFunc", None)
        if G is not None and "__call__" in vars(G):
            orig = vars(G)["__call__"]

            def gu_call(g, *args, **kwargs):
                tr = _active
                if tr is None:
                    return orig(g, *args, **kwargs)
                name = getattr(g, "__name__", None) or getattr(g, "_name", "gufunc")
                return tr._op("cupy." + str(name), functools.partial(orig, g), args, kwargs, _an_generic(()))

            self._set(G, "__call__", functools.wraps(orig)(gu_call))

    def _patch_jit(self, jit) -> None:
        iface = sys.modules.get("cupyx.jit._interface")
        J = getattr(iface, "_JitRawKernel", None)
        if J is None or "__call__" not in vars(J):
            return
        orig = vars(J)["__call__"]

        def call(k, grid, block, args, *rest, **kwargs):
            tr = _active
            if tr is None:
                return orig(k, grid, block, args, *rest, **kwargs)
            key = ("jit", id(k._func))
            name = getattr(k._func, "__name__", "kernel")
            return tr._op("cupyx.jit.rawkernel:" + name, functools.partial(orig, k), (grid, block, args) + rest,
                          kwargs, lambda t, a, kw, o, pre: t._raw(key, a[2]),
                          lambda a, kw: a[4] if len(a) > 4 else kw.get("stream"))

        self._set(J, "__call__", functools.wraps(orig)(call))

    # ------------------------------------------------------------------ patches: namespaces
    def _patch_cupy_namespace(self, cp) -> None:
        self._patch_namespace(cp, "cupy.")
        specials = {
            "asnumpy": (_an_d2h, lambda a, k: _arg(a, k, 1, "stream")),
            "asarray": (_an_asarray, None),
            "array": (_an_asarray, None),
            "asanyarray": (_an_asarray, None),
        }
        for name, (an, stream_of) in specials.items():
            orig = getattr(cp, name, None)
            if orig is not None:
                self._set(cp, name, _traced_function(orig, "cupy." + name, an, stream_of))

    def _patch_namespace_module(self, module) -> None:
        name = getattr(module, "__name__", "")
        if name in _NS_MODULES and name not in self._ns_done:
            self._ns_done.add(name)
            self._patch_namespace(module, name + ".")
            if module.__name__ == "cupy.random":
                RS = getattr(module, "RandomState", None)
                if isinstance(RS, type):
                    for attr, v in list(vars(RS).items()):
                        if (not attr.startswith("_") and isinstance(v, types.FunctionType)
                                and not getattr(v, "_streamsan_traced", False)):
                            self._set(RS, attr, _traced_method(
                                v, "cupy.random.RandomState." + attr, _an_generic(_INPLACE.get(attr, ()))))

    def _patch_namespace(self, module, prefix) -> None:
        ufunc = self.cp.ufunc
        for k, v in list(vars(module).items()):
            if (k.startswith("_") or k in _NS_DENY or isinstance(v, (type, types.ModuleType))
                    or type(v) is _UfuncProxy):
                continue
            if isinstance(v, ufunc):
                self._set(module, k, _UfuncProxy(v, prefix + k))
            elif type(v).__name__ in ("function", "builtin_function_or_method", "cython_function_or_method",
                                      "fused_cython_function"):
                if getattr(v, "_streamsan_traced", False):
                    continue
                self._set(module, k, _traced_function(v, prefix + k, _an_generic(_INPLACE.get(k, ()))))

    def _patch_cupyx(self, cupyx) -> None:
        self._patch_namespace_module(cupyx)
        pa = sys.modules.get("cupyx._pinned_array")
        for name in ("empty_pinned", "zeros_pinned", "empty_like_pinned", "zeros_like_pinned"):
            for mod in (cupyx, pa):
                orig = getattr(mod, name, None) if mod is not None else None
                if orig is None or getattr(orig, "_streamsan_traced", False):
                    continue
                self._set(mod, name, _pinned_factory(orig))


# ------------------------------------------------------------------------------------- wrapper factories
def _traced_function(fn, name, analyze, stream_of=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = _active
        if t is None:
            return fn(*args, **kwargs)
        return t._op(name, fn, args, kwargs, analyze, stream_of)

    wrapper._streamsan_traced = True
    return wrapper


def _traced_method(fn, name, analyze, stream_of=None):
    def method(*args, **kwargs):
        t = _active
        if t is None:
            return fn(*args, **kwargs)
        return t._op(name, fn, args, kwargs, analyze, stream_of)

    try:
        functools.update_wrapper(method, fn)
    except (AttributeError, TypeError):
        pass
    method._streamsan_traced = True
    return method


def _an_generic(inplace):
    inplace = tuple(inplace)
    return lambda t, args, kwargs, out, pre: t._generic(args, kwargs, out, inplace)


def _an_setitem(t, args, kwargs, out, pre):
    return t._setitem(args, kwargs, out, pre)


def _an_d2h(t, args, kwargs, out, pre):
    return t._d2h(args, kwargs, out, pre)


def _an_d2h_value(t, args, kwargs, out, pre):
    return t._d2h_value(args, kwargs, out, pre)


def _an_set(t, args, kwargs, out, pre):
    return t._set_h2d(args, kwargs, out, pre)


def _an_asarray(t, args, kwargs, out, pre):
    return t._asarray(args, kwargs, out, pre)


def _ndarray_base(nd):
    return nd.__mro__[1] if nd.__flags__ & (1 << 9) else nd


GRAPH_NOTE = ("CuPy CUDA graphs: calls captured into a graph (Stream.begin_capture) and the graph's launches are "
              "not analyzed")


def _np_data(arr) -> int:
    return arr.__array_interface__["data"][0]


def _c_strides(shape, itemsize):
    out = []
    s = itemsize
    for n in reversed(shape):
        out.append(s)
        s *= max(n, 1)
    return tuple(reversed(out))


def _pitched(space, ptr, pitch, width, height):
    if width <= 0 or height <= 0:
        return None
    if height == 1 or pitch == width:
        return (space, ptr, width * height if pitch == width else width)
    return (space, ptr, pitch * (height - 1) + width, (1, (height, width), (pitch, 1)))


def _threading_getprofile():
    get = getattr(threading, "getprofile", None)
    return get() if get is not None else getattr(threading, "_profile_hook", None)


def _transparent_subclass(base, name, body):
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


class _TracedFunction:
    """A ``cupy.cuda.function.Function`` from a traced ``RawModule``: launches are traced, the rest delegates."""

    def __init__(self, fn, key, names, name):
        self._fn = fn
        self._streamsan_key = key
        self._streamsan_names = names
        self._name = name

    def __call__(self, grid, block, args, *rest, **kwargs):
        t = _active
        if t is None:
            return self._fn(grid, block, args, *rest, **kwargs)
        key = self._streamsan_key
        return t._op("cupy.RawModule:" + self._name, self._fn, (grid, block, args) + rest, kwargs,
                     lambda tr, a, kw, o, pre: tr._raw(key, a[2]),
                     lambda a, kw: a[4] if len(a) > 4 else kw.get("stream"))

    def __getattr__(self, item):
        return getattr(self._fn, item)

    @property
    def __class__(self):
        return type(self._fn)

    def __repr__(self):
        return repr(self._fn)


class _UfuncProxy:
    """Stands for a ``cupy.ufunc`` in a namespace: calls and ufunc methods are traced, the rest delegates."""

    def __init__(self, uf, name):
        self._uf = uf
        self._name = name
        self.__doc__ = getattr(uf, "__doc__", None)
        self.__name__ = getattr(uf, "__name__", name.rsplit(".", 1)[-1])

    def __call__(self, *args, **kwargs):
        t = _active
        if t is None:
            return self._uf(*args, **kwargs)
        nin = self._uf.nin
        return t._op(self._name, self._uf, args, kwargs, _an_generic(range(nin, len(args))))

    def _method(self, meth, inplace, *args, **kwargs):
        f = getattr(self._uf, meth)
        t = _active
        if t is None:
            return f(*args, **kwargs)
        return t._op(f"{self._name}.{meth}", f, args, kwargs, _an_generic(inplace))

    def reduce(self, *args, **kwargs):
        return self._method("reduce", (3,), *args, **kwargs)

    def accumulate(self, *args, **kwargs):
        return self._method("accumulate", (3,), *args, **kwargs)

    def reduceat(self, *args, **kwargs):
        return self._method("reduceat", (4,), *args, **kwargs)

    def outer(self, *args, **kwargs):
        return self._method("outer", (), *args, **kwargs)

    def at(self, *args, **kwargs):
        return self._method("at", (0,), *args, **kwargs)

    def __getattr__(self, item):
        return getattr(self._uf, item)

    @property
    def __class__(self):
        return type(self._uf)

    def __repr__(self):
        return repr(self._uf)


def _make_hook(cp, tracer):
    class _Hook(cp.cuda.MemoryHook):
        name = "streamsan"

        def malloc_postprocess(self, **kw):
            tracer._on_malloc(kw.get("device_id", 0), kw.get("mem_ptr", 0), kw.get("mem_size", 0))

        def free_preprocess(self, **kw):
            tracer._on_free(kw.get("device_id", 0), kw.get("mem_ptr", 0))

    return _Hook()


def _pinned_factory(orig):
    @functools.wraps(orig)
    def make(*args, **kwargs):
        out = orig(*args, **kwargs)
        if _active is not None:
            cls = pinned_class()
            if not isinstance(out, cls):
                out = out.view(cls)
        return out

    make._streamsan_traced = True
    return make


def __getattr__(name):  # ``PinnedArray`` without importing NumPy at module import
    if name == "PinnedArray":
        return pinned_class()
    raise AttributeError(name)
