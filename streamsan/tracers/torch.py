"""The torch tracer: turns a live PyTorch program into streamsan events.

What it watches:

* every aten op, through a ``TorchDispatchMode``: its read and write sets from the schema's alias information
  (in-place and ``out=`` arguments are writes, fresh outputs are writes, view and metadata-only arguments are
  not accesses; optional tensors are), as byte ranges of device memory or pinned host memory, on the stream
  current at dispatch; ops on pinned CPU tensors with no CUDA tensor involved are host accesses. Where the
  schema does not tell, the op's own ops are traced instead: composite ops that inference mode hands over whole
  (``to``, ``reshape``, ``dropout``... through their C++ kernel) and ops implemented in Python (custom ops, with
  the mode on; one access by their schema too where their own work is not seen); batch norm writes its running
  statistics in training;
* events, waits, synchronizations, allocations and frees, through PyTorch's GPU trace callbacks;
* what those miss: ``record_stream`` (an aten op), ``Event.query()`` / ``Stream.query()`` returning True
  (patched, on ``torch.cuda`` and on the generic ``torch.Event`` / ``torch.Stream``), copies into pageable
  host memory (CUDA returns only after them: modelled as a host sync),
  pinned allocations (outputs of pinning ops and of non-blocking device-to-host copies), host reads that
  launch no aten op (``Tensor.tolist()``; ``Tensor.numpy()`` views, which report their accesses as they happen,
  :mod:`.pinned_numpy`, and read when the array is gone) on pinned memory,
  ``record_stream`` under ``no_dispatch()``, ``UntypedStorage.resize_``, and ``torch.cuda.use_mem_pool`` (the
  allocations it routes to a private pool carry the pool);
* CUDA graphs: ops during capture are kept as the graph's accesses, and each ``replay()`` is one op on the
  replaying stream (:meth:`TorchTracer._replay`);
* host writes to pinned staging buffers that no traced call shows, by the bytes they change at the next
  asynchronous copy out of the same place (:mod:`streamsan.tracers.staging`).

It never synchronizes, waits on events, reads device memory or changes streams (DESIGN §5): it reads tensor
metadata and stream handles, and the bytes of small pinned host buffers that asynchronous copies read. Events
fired inside an op (its allocations, the synchronization of a blocking copy) are placed around the op's own event
so that allocations precede the op and syncs follow it.
A collective that runs on a communication stream of its own keeps its tensors alive until it has run (modelled as
``record_stream`` on that stream).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import events as E
from ..agents import StreamRegistry
from ..analysis.locations import ENGINE_FRAME
from ..stacks import USER, StackTable, is_own_file
from .graphs import GraphAccesses
from .indices import DERIVED, INDEX_DTYPES, INDEXED_OPS, IndexValues, flat_values, indexed_rows
from .naming import caller_name
from .pinned_numpy import attach, detach, pinned_class, strided_range
from .staging import WRITE_SEEN, PinnedStaging
from .triton import kernel_writes

_STRIDED = torch.strided
_Tensor = torch.Tensor
_OP, _ALLOC, _FREE = E.OP, E.ALLOC, E.FREE
_get_ident = threading.get_ident
_cuda_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)
_current_autograd_node = getattr(torch._C, "_current_autograd_node", None)
_CUDA_TYPE = 1  # torch.Stream.device_type of a CUDA stream (c10::DeviceType::CUDA)

# In-place ops that change only metadata (or rebind storage): their alias annotation says "write", but they
# launch no kernel on the data.
METADATA_INPLACE = frozenset({
    "transpose_", "t_", "squeeze_", "unsqueeze_", "as_strided_", "swapdims_", "swapaxes_", "detach_", "set_",
    "resize_", "resize_as_", "_resize_output_", "_coalesced_", "requires_grad_", "retain_grad",
})
# Ops that touch no tensor data at all.
NO_ACCESS = frozenset({
    "is_pinned", "_pin_memory", "record_stream", "size", "stride", "numel", "dim", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "storage_offset", "is_contiguous", "is_non_overlapping_and_dense",
    "_nested_tensor_size", "_nested_tensor_strides", "empty", "empty_strided", "empty_like", "new_empty",
    "new_empty_strided", "_empty_affine_quantized", "lift_fresh", "alias", "detach", "_has_compatible_shallow_copy_type",
    "data", "is_same_size", "_version", "set_data", "_fw_primal", "_make_dual", "_unpack_dual", "resize_",
    "wait_tensor",  # _c10d_functional: makes the current stream wait for the collective (an event wait)
    "_unsafe_view",  # a view whose schema does not say so (matmul's reshapes): no kernel, no access
    "unsafe_split", "unsafe_split_with_sizes",  # views too (torch.unsafe_chunk's)
})
# Ops whose CPU output is pinned memory.
PINNING = frozenset({"_pin_memory", "pin_memory"})
# Ops of these namespaces enqueue their kernels on a communication stream of their own (NCCL's), after making it
# wait for the current stream.
COLLECTIVE_NAMESPACES = ("c10d::", "_c10d_functional::")
# Namespaces of PyTorch's own ops, whose kernels are C++ (none is looked for in Python: OpPlan.python_kernel).
OWN_KERNELS = ("aten::", "prims::", "c10d::", "_c10d_functional::", "profiler::", "quantized::", "_quantized::",
               "rngprims::", "inductor::")
COPIES = frozenset({"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "to"})
# Composite ops whose schema does not say what their kernel touches: a result that may be an input itself or a
# view of it (dropout outside training, type_as to the same dtype, broadcast_tensors), inputs written in place
# (batch_norm's running statistics). They run through their decomposition (OpPlan.decompose).
# tests/test_torch_schema_audit.py checks the list against PyTorch's op database.
SCHEMA_HIDES = frozenset({
    "dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "type_as", "atleast_1d", "atleast_2d", "atleast_3d",
    "to_dense", "batch_norm", "instance_norm", "_batch_norm_impl_index", "cartesian_prod", "conj_physical",
    "unsafe_chunk", "broadcast_tensors", "meshgrid", "histogramdd",
})
# Batch norm kernels that update the running statistics in place without a schema annotation: the position of
# their ``training`` flag (they write the statistics only in training), or None (they always do).
STATISTICS_WRITES = {"native_batch_norm": 5, "cudnn_batch_norm": 5, "miopen_batch_norm": 5,
                     "batch_norm_gather_stats": None, "batch_norm_gather_stats_with_counts": None}
RUNNING_STATISTICS = ("running_mean", "running_var")
_FACTORY_SUFFIX = ("_like",)
_FACTORY_PREFIX = ("new_",)


def _direct_call(func):
    """What to call to run an op overload: ``OpOverload.__call__`` only forwards to the C++ handle ``_op``, so the
    tracer calls the handle and saves a Python frame per op; anything else (a subclass, a ``__call__`` that does
    more in another torch) is called as it is."""
    call = getattr(type(func), "__call__", None)
    code = getattr(call, "__code__", None)
    if call is _OVERLOAD_CALL and code is not None and code.co_names == ("_op",):
        op = getattr(func, "_op", None)
        if callable(op):
            return op
    return func


_DisableTorchDispatch = torch._C._DisableTorchDispatch  # (thread-local: dispatch modes skipped in its block)
_OVERLOAD_CALL = getattr(getattr(torch._ops, "OpOverload", None), "__call__", None)


class OpPlan:
    """How to read one op overload's accesses from its arguments, derived once from its schema.

    ``tensor_args``: (position, name, is_write, is_list) for every tensor argument the kernel touches (a list
    of lists, ``Tensor[][]``, is flattened at dispatch).
    ``fresh_outputs``: whether returned tensors are new memory the op writes. ``skip``: no access at all.
    ``python_kernel``: for an op implemented in Python (``torch.library.custom_op``, ``Library.impl``), the
    dispatch keys of that implementation for CUDA tensors and for others (None where the kernel is not Python):
    the tracer runs it with the mode on, so it sees its ops on the streams they run on (the implementation may
    switch streams: an op on the current stream by its schema would hide that).
    ``training_args``: for batch norm kernels, the training flag's position and the tensor arguments when it is
    true (the running statistics written: :data:`STATISTICS_WRITES`).
    ``decompose``: for a composite op whose schema hides what it touches (``to``, ``reshape``, ``contiguous``:
    the input itself or a copy; ``dropout``, ``batch_norm``...), its C++ composite kernel (else None). PyTorch
    runs composite ops whole through the dispatch mode only in inference mode (elsewhere they decompose before
    it); the tracer runs that kernel, so it sees the copies they make (``_to_copy``, ``clone``) and nothing where
    they make none, as outside inference mode.
    ``call``: what runs the op (:func:`_direct_call`). ``fast``: what the C tracer reads (``streamsan/_ctracer.c``):
    (kind, call, name, tensor_args, fresh_outputs, is_copy), kind 0 for ops only the Python path handles.
    """

    __slots__ = ("func", "call", "name", "tensor_args", "fresh_outputs", "skip", "metadata_inplace", "is_copy",
                 "pinning", "pinning_or_copy", "record_stream", "collective", "indexed", "arange", "base", "derives",
                 "decompose", "python_kernel", "training_args", "fast")

    def __init__(self, func):
        self.func = func
        self.call = _direct_call(func)
        schema = func._schema
        base = schema.name.split("::")[-1]
        self.name = schema.name + ("." + schema.overload_name if schema.overload_name else "")
        self.metadata_inplace = base in METADATA_INPLACE
        self.is_copy = base in COPIES
        self.pinning = base in PINNING
        self.collective = schema.name.startswith(COLLECTIVE_NAMESPACES)
        self.pinning_or_copy = self.pinning or self.is_copy
        self.record_stream = schema.name == "aten::record_stream"
        self.indexed = INDEXED_OPS.get(self.name)  # an index-addressed op (streamsan.tracers.indices)
        self.arange = base == "arange"
        self.base = base
        self.derives = base in DERIVED  # (its integer results are computed from known index values)
        self.decompose = _composite_kernel(func) if _schema_hides_accesses(schema, base) else None
        self.python_kernel = None if schema.name.startswith(OWN_KERNELS) else _python_kernel(func)
        factory = base.endswith(_FACTORY_SUFFIX) or base.startswith(_FACTORY_PREFIX)
        # c10d's in-place collectives carry no alias annotations: every tensor they take may be written
        inplace_collective = self.collective and base.endswith("_")
        args = []
        for i, a in enumerate(schema.arguments):
            t = a.type
            kind = _tensor_kind(t)
            if kind is None:
                continue
            alias = a.alias_info
            # (an optional tensor of a collective is an input: allreduce_'s sparse_indices)
            is_write = bool(alias is not None and alias.is_write) or (
                inplace_collective and not str(t).startswith("Optional"))
            if alias is not None and not is_write:
                continue  # a view of this argument: metadata only
            if factory and not is_write:
                continue  # *_like / new_*: only the input's metadata
            if self.metadata_inplace:
                continue
            args.append((i if not a.kwarg_only else -1, a.name, is_write, kind != "tensor"))
        self.tensor_args = tuple(args)
        self.training_args = None  # (position of `training`, tensor_args when it is true)
        if base in STATISTICS_WRITES:
            updated = tuple((p, n, w or n in RUNNING_STATISTICS, li) for p, n, w, li in args)
            if STATISTICS_WRITES[base] is None:
                self.tensor_args = updated
            else:
                self.training_args = (STATISTICS_WRITES[base], updated)
        self.fresh_outputs = bool(schema.returns) and all(
            r.alias_info is None for r in schema.returns) and any(_tensor_kind(r.type) for r in schema.returns)
        no_access = base in NO_ACCESS and not self.pinning and not (base == "_unsafe_view" and schema.overload_name)
        self.skip = self.decompose is None and (
            no_access or (not self.tensor_args and not self.fresh_outputs))  # (_unsafe_view.out copies)
        if self.decompose is not None or self.python_kernel is not None or self.training_args is not None:
            kind = _FAST_NONE
        elif self.skip:
            kind = _FAST_NONE if self.record_stream else _FAST_ALLOCATING if self.fresh_outputs else _FAST_UNTOUCHED
        else:
            kind = _FAST_NONE if self.pinning or self.collective or self.indexed else _FAST_ACCESSES
        self.fast = (kind, self.call, self.name, self.tensor_args, self.fresh_outputs, self.is_copy)


def _schema_hides_accesses(schema, base: str) -> bool:
    """Whether an op's accesses cannot be read from its schema: its result aliases an input (``to``, ``reshape``,
    ``contiguous``, ``flatten``...: the input itself, or a copy of it), or it is one of :data:`SCHEMA_HIDES`."""
    return base in SCHEMA_HIDES or any(r.alias_info is not None and not r.alias_info.is_write
                                        for r in schema.returns)


def _in_custom_backward() -> bool:
    """Whether a Python caller runs inside a custom ``autograd.Function``'s backward (the engine calls it through
    ``BackwardCFunction.apply`` in torch/autograd/function.py), rather than in a hook the engine calls directly."""
    f = sys._getframe(1)  # (an engine thread may hold no Python frame below the tracer's own)
    while f is not None:
        code = f.f_code
        if code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_PY):
            return True
        f = f.f_back
    return False


_FUNCTION_PY = os.path.join("torch", "autograd", "function.py")


def _covers(w, r) -> bool:
    """Whether range w holds all of range r's bytes (same space)."""
    return w[0] == r[0] and w[1] <= r[1] and r[1] + r[2] <= w[1] + w[2]


def _composite_kernel(func):
    """An op's C++ CompositeImplicitAutograd kernel, as a callable (what runs outside inference mode; not
    ``OpOverload.decompose``, which prefers Python decompositions: ``dropout``'s clones its input), or None."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    op_dk = getattr(func, "_op_dk", None)
    try:
        if op_dk is None or not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key):
            return None
    except (AttributeError, RuntimeError, TypeError):
        return None
    return functools.partial(op_dk, key)  # (no frame of its own: an error inside is the program's)


def _python_kernel(func):
    """(key, key): the dispatch keys of an op's Python implementation that run for CUDA tensors and for other
    arguments, each None where the kernel there is not Python (C++ or none); None if neither is. Read from the
    dispatcher's registrations: a Python kernel is registered at a line of a Python file."""
    try:
        dump = torch._C._dispatch_dump(func.name())
    except (AttributeError, RuntimeError, TypeError):
        return None
    python = {}
    for line in dump.splitlines():
        key, sep, rest = line.partition(": registered at ")
        if sep and key.replace("[alias]", "").isidentifier():
            where = rest.split(" :: ")[0]
            python[key.replace("[alias]", "")] = bool(_PYTHON_SITE.search(where))

    def effective(keys):
        for k in keys:
            if k in python:
                return getattr(torch._C.DispatchKey, k, None) if python[k] else None
        return None

    generic = ("CompositeExplicitAutograd", "CompositeImplicitAutograd")
    cuda, other = effective(("CUDA",) + generic), effective(("CPU",) + generic)
    return None if cuda is None and other is None else (cuda, other)


_PYTHON_SITE = re.compile(r"(\.py|^<[^>]*>):\d+$")


# OpPlan.fast kinds: what the C tracer does with an op (streamsan/_ctracer.c)
_FAST_NONE, _FAST_UNTOUCHED, _FAST_ALLOCATING, _FAST_ACCESSES = 0, 1, 2, 3


def _tensor_kind(t):
    """"tensor", "list" or "nested" for a schema type holding tensors (optional ones too: ``Tensor? bias`` is
    spelt ``Optional[Tensor]``), else None."""
    s = str(t)
    if s in ("Tensor", "Tensor?", "Optional[Tensor]"):
        return "tensor"
    if s in ("Tensor[]", "Tensor?[]", "List[Tensor]", "List[Optional[Tensor]]", "Tensor(a)[]", "Tensor(a!)[]",
             "Optional[List[Tensor]]", "Optional[List[Optional[Tensor]]]"):
        return "list"
    if s in ("List[List[Tensor]]", "Tensor[][]"):
        return "nested"
    if s.startswith("Tensor") and "[]" in s:
        return "list"
    return None


_descriptions: dict = {}


def describe(t) -> str:
    """``dtype[shape]`` of a tensor, e.g. ``bfloat16[1, 8, 512, 128]``."""
    key = (t.dtype, t.shape)
    d = _descriptions.get(key)
    if d is None:
        if len(_descriptions) > 4096:
            _descriptions.clear()
        d = _descriptions[key] = f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
    return d


class _Mode(TorchDispatchMode):
    """The dispatch mode; all work is in :meth:`TorchTracer._dispatch`.

    PyTorch wraps a mode's ``__torch_dispatch__`` so that Dynamo never compiles it, at a cost of about a
    microsecond per op. streamsan skips that wrapper: once Dynamo is loaded, streamsan's files are put on Dynamo's
    skip list instead (:func:`_dynamo_safe`), which costs nothing per op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer
        _ALLOCATOR.modes.add(self)
        ctracer = _c_tracer() if not _ALLOCATOR.unreported else None
        if ctracer is not None and type(self).__torch_dispatch__ is _Mode.__torch_dispatch__:
            # PyTorch calls this instance attribute: the C tracer, which leaves what it does not handle to the
            # method below
            try:
                self.__torch_dispatch__ = ctracer.Dispatch(tracer, _Mode.__torch_dispatch__.__get__(self), self)
            except (TypeError, AttributeError) as exc:  # a tracer it does not know: the Python tracer alone
                tracer._note_once("c-tracer", f"the C tracer is off ({exc}); the Python tracer runs alone")
            else:
                if tracer.stacks.native is None:  # StackTable.outside in C too
                    tracer.stacks.native = self.__torch_dispatch__.capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.tracer.tracing:
            if self.tracer.graphs.current is None:
                return func(*args, **(kwargs or {}))
            return self._guarded(self.tracer._dispatch_captured, func, types, args, kwargs or {})
        try:
            tracer = self.tracer
            plan = tracer.plans.get(id(func)) or tracer._plan(func)
            call = plan.decompose
            if call is not None:
                with self:  # (the mode is off inside its own handler: on again for the ops inside)
                    return call(*args, **(kwargs or {}))
            if plan.python_kernel is not None and not types:  # (a subclass's own dispatch handles its ops)
                kwargs = kwargs or {}
                dev = _cuda_device_among(itertools.chain(args, kwargs.values()))
                key = plan.python_kernel[0 if dev >= 0 else 1]
                if key is not None:
                    return tracer._run_python_kernel(self, func, plan, key, dev, args, kwargs)
            if types:  # tensor subclasses (plain tensors give none)
                kind = _subclass_kind(types)
                if kind == _MEMORYLESS:
                    return func(*args, **(kwargs or {}))
                if kind == _WRAPPER:
                    return self.tracer._dispatch_wrapped(func, args, kwargs or {})
            return tracer._dispatch(func, args, kwargs or {}, plan)
        except Exception as exc:
            ran = self.tracer._internal_error(exc, func)
            if ran is None:  # the op's own error: the program sees it as without streamsan
                raise
            return ran[1] if ran[0] else func(*args, **(kwargs or {}))

    def _guarded(self, handler, func, types, args, kwargs):
        """``handler(func, types, args, kwargs)`` under the same guard as the dispatch above (which spells it out:
        it is the hot path)."""
        try:
            return handler(func, types, args, kwargs)
        except Exception as exc:
            ran = self.tracer._internal_error(exc, func)
            if ran is None:
                raise
            return ran[1] if ran[0] else func(*args, **kwargs)


def _c_tracer():
    """The C tracer (``streamsan/_ctracer.c``), configured for this module, or None: not built
    (no C compiler at install), Python before 3.11, or ``STREAMSAN_CORE=python`` in the environment."""
    if os.environ.get("STREAMSAN_CORE", "").strip().lower() == "python" or _cuda_raw_stream is None:
        return None
    try:
        from .. import _ctracer
    except ImportError:
        return None
    if not getattr(_ctracer, "AVAILABLE", 0):
        return None
    _ctracer.configure(_Tensor, _cuda_raw_stream, describe, _descriptions, E.OP, E.ALLOC, E.FREE, USER,
                       _C_DEVICE_ATTR, _C_DEVICE_OFFSET)
    return _ctracer


# Which tensors the C tracer takes for device tensors, and what it adds to their get_device() (the CPU stand-in of
# bench/standin.py sets these for its CPU tensors)
_C_DEVICE_ATTR, _C_DEVICE_OFFSET = "is_cuda", 0

_NO_MEMORY = ("FakeTensor", "FunctionalTensor")
_PLAIN, _MEMORYLESS, _WRAPPER = 0, 1, 2
_subclass_kinds: dict = {}


def _subclass_kind(types) -> int:
    """What the tensor subclasses of an op are: fake tensors of tracing compilers and functionalization wrappers
    stand for no real memory (such ops are not accesses); wrapper subclasses (DTensor, ...: they declare their
    inner tensors with ``__tensor_flatten__``) run the op on inner tensors the dispatch mode does not see;
    anything else is memory of its own."""
    kind = _PLAIN
    for ty in types:
        k = _subclass_kinds.get(ty)
        if k is None:
            k = _subclass_kinds[ty] = _MEMORYLESS if any(c.__name__ in _NO_MEMORY for c in ty.__mro__) else \
                _WRAPPER if hasattr(ty, "__tensor_flatten__") else _PLAIN
        if k == _MEMORYLESS:
            return k
        kind = kind or k
    return kind


def _plain_tensors(obj):
    """The tensors with memory of their own in an op argument or result: wrapper subclasses are replaced by their
    inner tensors, recursively; lists and tuples are walked."""
    if isinstance(obj, torch.Tensor):
        if hasattr(type(obj), "__tensor_flatten__"):
            for name in obj.__tensor_flatten__()[0]:
                yield from _plain_tensors(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _plain_tensors(x)


def _dynamo_safe() -> None:
    """Keep Dynamo from compiling the tracer's own frames (they run inside compiled functions' eager parts).

    Puts the ``streamsan`` package on Dynamo's skip list; a torch without that list gets PyTorch's per-call
    wrapper around the mode's dispatch instead."""
    global _dynamo_skipped
    if _dynamo_skipped:
        return
    try:
        from torch._dynamo import trace_rules

        trace_rules.add(__name__.split(".")[0])
        _dynamo_skipped = True
        return
    except (ImportError, AttributeError):
        pass
    raw = _Mode.__dict__["__torch_dispatch__"]
    if not getattr(raw, "_streamsan_dynamo_safe", False):
        safe = torch._disable_dynamo(raw, recursive=True)
        safe._streamsan_dynamo_safe = True
        _Mode.__torch_dispatch__ = safe


_dynamo_skipped = False


class _GpuTrace:
    """Routes PyTorch's process-wide GPU trace callbacks to the active tracer (they cannot be unregistered).

    PyTorch calls each registry's ``fire_callbacks``, a Python loop over its callbacks. On the registries it uses,
    streamsan makes its own callback that method while it is the only one there (one Python call per allocation,
    free or event), and a loop that calls streamsan's first and then the others once someone else (CSAN, a
    profiler) registers one. An exception in any callback is logged, never raised into PyTorch."""

    active = None
    installed = False
    python_callbacks = ()  # (allocation, free, event record, event wait): the Python callbacks (the C ones fall
    # back on them)

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        import torch.cuda._gpu_trace as gt

        torch._C._activate_gpu_trace()

        def on(registry, name, capturing=False):
            def callback(*args):
                t = cls.active
                if t is not None and (t.tracing or capturing and t.graphs.current is not None):
                    try:
                        getattr(t, name)(*args)
                    except Exception:
                        _log_callback_error(registry.name)
            return callback

        def on_alloc(ptr):  # the hottest two, spelled out: an op's own allocation, and a free
            t = cls.active
            if t is not None and t.tracing:
                try:
                    cur = t.op_agent
                    if cur is not None and cur[4] == _get_ident() and not t.pool_of_thread:
                        t.live_device[ptr] = cur[0]
                        cur[5].append((_ALLOC, cur[0], ptr, 0, cur[1], cur[2], cur[3], ""))
                    else:
                        t._on_alloc(ptr)
                except Exception:
                    _log_callback_error(gt.MemoryAllocationCallbacks.name)

        def on_free(ptr):
            t = cls.active
            if t is not None and t.tracing:
                try:
                    dev = t.live_device.pop(ptr, None)
                    if dev is not None:
                        t._emit((_FREE, dev, ptr, 0))
                        if t._engine_grads:
                            t._engine_grads.discard(ptr)
                except Exception:
                    _log_callback_error(gt.MemoryDeallocationCallbacks.name)

        on_record = on(gt.EventRecordCallbacks, "_on_event_record", capturing=True)  # (also edges of a graph)
        on_wait = on(gt.EventWaitCallbacks, "_on_event_wait", capturing=True)
        cls.python_callbacks = (on_alloc, on_free, on_record, on_wait)
        ctracer = _c_tracer()
        if ctracer is not None:  # their common case in C
            on_alloc, on_free = ctracer.Callback(cls, on_alloc, 0), ctracer.Callback(cls, on_free, 1)
            on_record = ctracer.Callback(cls, on_record, 2, E.EVENT_RECORD)
            on_wait = ctracer.Callback(cls, on_wait, 2, E.EVENT_WAIT)
        for registry, callback in (
                (gt.EventDeletionCallbacks, on(gt.EventDeletionCallbacks, "_on_event_delete")),
                (gt.EventRecordCallbacks, on_record), (gt.EventWaitCallbacks, on_wait),
                (gt.MemoryAllocationCallbacks, on_alloc), (gt.MemoryDeallocationCallbacks, on_free),
                (gt.DeviceSynchronizationCallbacks, on(gt.DeviceSynchronizationCallbacks, "_on_device_sync")),
                (gt.StreamSynchronizationCallbacks, on(gt.StreamSynchronizationCallbacks, "_on_stream_sync")),
                (gt.EventSynchronizationCallbacks, on(gt.EventSynchronizationCallbacks, "_on_event_sync"))):
            _call_directly(registry, callback)
        cls.installed = True


def _call_directly(registry, ours) -> None:
    """Register ``ours`` (which logs its own errors) on a registry and make it the registry's ``fire_callbacks``
    while it is the only callback there; once there are others, ``fire_callbacks`` calls ours, then them."""
    registry.add_callback(ours)
    add = registry.add_callback

    def add_callback(cb):
        add(cb)
        registry.fire_callbacks = _direct_fire(registry, ours)

    registry.add_callback = add_callback
    registry.fire_callbacks = ours if len(registry.callback_list) == 1 else _direct_fire(registry, ours)


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


MAX_ATTRIBUTES = 30


# PyTorch's CUDA allocators that report nothing to its GPU trace: the cudaMallocAsync backend, and an allocator
# of the program's own (``torch.cuda.memory.change_current_allocator``, e.g. RMM's), which allocates on the current
# stream and frees on the stream it allocated on.
UNREPORTING_BACKENDS = ("cudaMallocAsync", "pluggable")


class AllocatorBackend:
    """Whether PyTorch's CUDA allocator reports its allocations and frees to the GPU trace (the native caching
    allocator does; ``UNREPORTING_BACKENDS`` do not). Known once CUDA is initialized (asking earlier would read
    ``PYTORCH_CUDA_ALLOC_CONF`` before the program sets it, and a program's own allocator must be in place by
    then), the same for the whole process; ``name`` is the backend's.

    Where it does not, the tracer declares each op's new CUDA outputs itself (ALLOC in ``E.UNREPORTED_POOL``), so
    only the Python tracer runs: every dispatch mode made so far (``modes``) leaves the C one; and it learns their
    frees from their storages (:meth:`watch`)."""

    __slots__ = ("unreported", "name", "modes", "watched", "deaths_seen")

    def __init__(self):
        self.unreported: bool | None = None  # None: not known yet
        self.name = ""
        self.modes = weakref.WeakSet()
        self.watched: dict[int, tuple] = {}  # base pointer -> (tracer, weak reference to the storage there)
        self.deaths_seen: bool | None = None  # whether a storage's death can be watched (learnt at the first watch)

    def watch(self, tracer, dev: int, base: int, storage) -> None:
        """The free of a block the allocator does not report, for ``tracer``: when its storage dies (PyTorch keeps a
        storage's Python object alive as long as the storage itself, so a weak reference to it dies with the last
        tensor on it), or when the storage is resized (:meth:`resized`). PyTorch frees a block on the stream it was
        allocated on, after the streams recorded on it: the free the analyzer's missing-record-stream rule
        expects. Not where PyTorch lets a storage's Python object die before the storage (then no free is seen)."""
        if self.deaths_seen is None:
            self.deaths_seen = _storage_objects_live_with_their_storage()
        if not self.deaths_seen:
            return
        watched = self.watched

        def freed(ref):
            if watched.get(base, (None, None))[1] is ref:
                del watched[base]
                if tracer.tracing:
                    tracer._emit((E.FREE, dev, base, 0))

        watched[base] = (tracer, weakref.ref(storage, freed))

    def resized(self, tracer, base: int) -> bool:
        """A watched storage of ``tracer`` left its block at ``base`` (a resize): whether it was watched there."""
        w = self.watched.get(base)
        if w is None or w[0] is not tracer:
            return False
        del self.watched[base]
        return True

    def forget(self, tracer) -> None:
        """A stopped tracer's blocks are watched no more."""
        for base in [b for b, w in self.watched.items() if w[0] is tracer]:
            del self.watched[base]

    def learn(self) -> bool | None:
        if self.unreported is None:
            try:
                if not torch.cuda.is_initialized():
                    return None
                self.name = torch.cuda.get_allocator_backend()
                self.unreported = self.name in UNREPORTING_BACKENDS
            except Exception:  # a torch without the query: its only allocator is the native one
                self.unreported = False
            if self.unreported:
                for mode in list(self.modes):
                    mode.__dict__.pop("__torch_dispatch__", None)  # (PyTorch looks it up at every op)
        return self.unreported


def _storage_objects_live_with_their_storage() -> bool:
    """Whether a storage's Python object stays alive while a tensor holds the storage (PyTorch's PyObject
    preservation for storages), so that a weak reference to it dies with the storage."""
    t = torch.empty(1)
    ref = weakref.ref(t.untyped_storage())
    alive = ref() is not None
    del t
    return alive and ref() is None


_ALLOCATOR = AllocatorBackend()
UNREPORTED_NOTE = ("PyTorch's {} CUDA allocator reports no allocations or frees: streamsan takes each op's new "
                   "outputs as memory allocated on the op's stream, freed when their storage dies, and runs its "
                   "Python tracer")


class _OpEvents(list):
    """The events a thread's callbacks fire inside one of its ops (its allocations, a copy's event record, a
    blocking copy's synchronization), kept apart from the buffer until the op is placed among them: another
    thread's events, or a flush, in the meantime cannot get between them or reorder them."""

    __slots__ = ()


class HostViews:
    """NumPy views of pinned memory still open (``t.numpy()`` views, :mod:`.pinned_numpy` views read at the latest
    when gone)."""

    __slots__ = ("opened",)

    def __init__(self):
        self.opened: dict = {}  # id -> (weak reference to a view, its host read to come)


class _RoutedToPool(contextlib.ContextDecorator):
    """``use_mem_pool``'s context manager, telling the tracer (``routing``: thread -> pool number) while the calling
    thread's allocations go to the pool; a decorator too, as the original is."""

    def __init__(self, cm, routing: dict, number: int):
        self.cm = cm
        self.routing = routing
        self.number = number
        self.prev = None

    def _recreate_cm(self):
        recreate = getattr(self.cm, "_recreate_cm", None)
        return _RoutedToPool(recreate(), self.routing, self.number) if recreate is not None else self

    def __enter__(self):
        out = self.cm.__enter__()
        tid = _get_ident()
        self.prev = self.routing.get(tid)
        self.routing[tid] = self.number
        return out

    def __exit__(self, *exc):
        tid = _get_ident()
        if self.prev is None:
            self.routing.pop(tid, None)
        else:
            self.routing[tid] = self.prev
        return self.cm.__exit__(*exc)


class GraphCaptures:
    """CUDA graphs' accesses: the capture in progress, and each captured graph's for its replays."""

    __slots__ = ("current", "accesses")

    def __init__(self):
        # while a graph is captured: (its reads, its writes, whether tracing was on, its nodes: OP, EVENT_RECORD
        # and EVENT_WAIT events in capture order)
        self.current = None
        self.accesses = GraphAccesses()


class TorchTracer:
    """Feeds events about the torch program into ``buffer`` (a :class:`streamsan.sink.EventBuffer`).

    ``streams`` / ``stacks``: the session's shared stream registry and stack table. ``scope="full"`` traces
    every op from :meth:`start`; ``scope="hooks"`` traces ops only inside :meth:`push_context` regions (entered by
    library hooks), and allocations and synchronizations from the first such region on.
    """

    def __init__(self, buffer, streams=None, stacks=None, scope: str = "full"):
        # Fewer than MAX_ATTRIBUTES instance attributes: past CPython's limit for key-sharing instance dicts every
        # attribute load of the hot path becomes a dict lookup (1.5% more instructions on bench/standin.py).
        self.buffer = buffer
        self.scope = scope
        self.streams = streams if streams is not None else StreamRegistry(buffer)
        self.agent_of = self.streams.agent_of
        self.stacks = stacks if stacks is not None else StackTable()
        # id(op overload) -> its plan (the plan holds the overload, so the id stays its own). Not keyed by the
        # overload itself: its __hash__ is a Python method, a frame per op.
        self.plans: dict = {}
        self.live_device: dict[int, int] = {}
        self.pinned: dict[int, int] = {}  # base pointer -> bytes of pinned host blocks seen
        self.ctx = 0
        self.op_agent = None  # (device, agent, stack, ctx, thread) of the op being dispatched, for its allocations
        self.saw_cuda = False
        self.running = False
        self.tracing = False  # running, and not inside a CUDA graph capture
        self.graphs = GraphCaptures()
        self.in_scope = 1 if scope == "full" else 0  # hooks scope: inside hooked regions (any thread)
        self._modes: list = []
        self._noted: set[str] = set()
        self.on_note = None  # the session's note function (also tells the user once); else a NOTE event
        self._scope_depth = threading.local()
        self._patched: list = []
        self._record_stream_seen = None  # the thread whose dispatch mode last saw a record_stream
        self.stacks.fallback = self._engine_stack
        self._backward_site: tuple = ()  # report frames of the latest backward() / autograd.grad() call
        # the autograd engine (see _engine_op): its threads (met running backward ops without Python frames), the
        # stacks of such ops, and the blocks of the gradients they made that are still alive
        self._engine_threads: set[int] = set()
        self._engine_sids: set[int] = set()
        self._engine_grads: set[int] = set()
        self.views = HostViews()
        self.staged = PinnedStaging(_storage_base)  # pinned blocks' bytes as asynchronous copies read them
        self.pool_of_thread: dict[int, int] = {}  # thread -> the memory pool its allocations go to (use_mem_pool)
        self.index_values = IndexValues()  # device index tensors' values seen on the host (copies, arange)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if "torch._dynamo" in sys.modules:
            _dynamo_safe()
        self._allocations_unreported()  # (known now if CUDA is up)
        if self.scope == "full":
            _GpuTrace.install()
        _GpuTrace.active = self
        self.running = self.tracing = True
        self._patch()
        attach(self)
        if self.scope == "full":
            self._enter_mode()
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
        while self._modes:
            mode = self._modes.pop()
            try:
                mode.__exit__(None, None, None)
            except Exception:
                pass
        self._unpatch()
        if _GpuTrace.active is self:
            _GpuTrace.active = None
        _ALLOCATOR.forget(self)
        self.buffer.flush()

    def _enter_mode(self):
        mode = _Mode(self)
        mode.__enter__()
        self._modes.append(mode)
        return mode

    def _thread_start(self, frame, event, arg):
        """Profile hook run once in each new thread: put the dispatch mode on that thread's mode stack."""
        import sys

        sys.setprofile(None)
        if self.running:
            _Mode(self).__enter__()

    # ------------------------------------------------------------------ agents
    def agent(self, device: int, handle: int) -> int:
        return self.streams.agent(device, handle)

    def name_stream(self, stream, name: str) -> None:
        """Give a stream (torch.cuda.Stream / torch.Stream) a role name for reports."""
        device, handle = _stream_key(stream)
        self.streams.name(device, handle, name)

    def _agent_for_handle(self, handle: int) -> int:
        return self.streams.for_handle(handle, _cuda_get_device)

    # ------------------------------------------------------------------ labels and context
    def label(self, tensor, text: str) -> None:
        r = self._range(tensor)
        if r is not None:
            base = r[1] - tensor.storage_offset() * tensor.element_size()
            self.buffer.events.append((E.LABEL, r[0], base, tensor.untyped_storage().nbytes(), text))

    def push_context(self, text: str) -> int:
        """Enter a hooked region: its accesses carry ``text`` as context; in hooks scope, tracing is on inside
        (and PyTorch's GPU trace callbacks get activated at the first region)."""
        prev = self.ctx
        self.ctx = self.buffer.context_id(text)
        if self.scope == "hooks":
            local = self._scope_depth
            depth = getattr(local, "n", 0)
            local.n = depth + 1
            if depth == 0 and self.running:
                _GpuTrace.install()
                self.in_scope += 1
                mode = getattr(local, "mode", None)  # one mode per thread, entered again at each region
                if mode is None:
                    mode = local.mode = _Mode(self)
                mode.__enter__()
                self._modes.append(mode)
        return prev

    def pop_context(self, prev: int) -> None:
        self.ctx = prev
        if self.scope == "hooks":
            local = self._scope_depth
            depth = local.n - 1
            local.n = depth
            mode = getattr(local, "mode", None)
            if depth == 0 and mode is not None and any(m is mode for m in self._modes):
                self.in_scope -= 1
                self._modes.remove(mode)  # this thread's, whichever thread entered a region last
                mode.__exit__(None, None, None)

    # ------------------------------------------------------------------ GPU trace callbacks
    def _emit(self, ev) -> None:
        """Append an event fired outside the dispatch mode's view (a callback, a patched method): inside an op of
        this thread, to the op's own list (:class:`_OpEvents`); else to the buffer. Ops flush the buffer when they
        end; this flushes only when callbacks alone have filled it several times over."""
        cur = self._op_of_this_thread()
        if cur is not None:
            cur[5].append(ev)
            return
        evs = self.buffer.events
        evs.append(ev)
        if len(evs) >= 4 * self.buffer.batch and self.op_agent is None:
            self.buffer.flush()

    def _on_event_delete(self, e):
        self.buffer.events.append((E.EVENT_DELETE, e))

    def _op_of_this_thread(self):
        """The op this thread is dispatching (its ``op_agent`` tuple), or None. ``op_agent`` is the op begun
        last, by any thread; ops of several threads may be under way at once (PyTorch releases the GIL inside
        ops), each in the buffer's ``ops_of_threads``."""
        cur = self.op_agent
        ident = _get_ident()
        if cur is not None and cur[4] == ident:
            return cur
        ops = self.buffer.ops_of_threads
        return ops.get(ident) if ops else None

    def _callback_stack(self) -> int:
        """The stack of a callback's event: inside an op of this thread, the op's own (the same stack, already
        captured); else captured here."""
        cur = self._op_of_this_thread()
        if cur is not None:
            return cur[2]
        return self.stacks.outside(self.buffer.events)

    def _on_event_record(self, e, s):
        ev = (E.EVENT_RECORD, e, self._agent_for_handle(s), self._callback_stack())
        cap = self.graphs.current
        if cap is not None and not self.tracing:  # an edge of the graph being captured
            cap[3].append(ev)
        else:
            self._emit(ev)

    def _on_event_wait(self, e, s):
        ev = (E.EVENT_WAIT, e, self._agent_for_handle(s), self._callback_stack())
        cap = self.graphs.current
        if cap is not None and not self.tracing:
            cap[3].append(ev)
        else:
            self._emit(ev)

    def _on_stream_sync(self, s):
        self._emit((E.STREAM_SYNC, self._agent_for_handle(s), self._callback_stack()))

    def _on_event_sync(self, e):
        self._emit((E.EVENT_SYNC, e, self._callback_stack()))

    def _on_device_sync(self):
        self._emit((E.DEVICE_SYNC, _cuda_get_device(), self._callback_stack()))

    def _on_alloc(self, ptr):
        pool = self.pool_of_thread.get(_get_ident(), 0) if self.pool_of_thread else 0
        tail = (pool,) if pool else ()
        cur = self._op_of_this_thread()
        if cur is None:  # outside an op
            if not self.in_scope:
                return
            dev = _cuda_get_device()
            cur = (dev, self.agent(dev, _cuda_raw_stream(dev)), 0, 0)
            self.live_device[ptr] = dev
            self._emit((E.ALLOC, dev, ptr, 0, cur[1], 0, 0, "") + tail)
            return
        dev, owner = cur[0], cur[1]
        if dev < 0:  # inside a host op: the current stream's allocation
            dev = _cuda_get_device()
            owner = self.agent(dev, _cuda_raw_stream(dev))
        self.live_device[ptr] = dev
        cur[5].append((E.ALLOC, dev, ptr, 0, owner, cur[2], cur[3], "") + tail)

    # ------------------------------------------------------------------ patches
    def _patch(self) -> None:
        tracer = self
        targets = []
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and hasattr(cuda, "Event"):
            targets.append((cuda.Event, "query", "event"))
            targets.append((cuda.Stream, "query", "stream"))
        for cls in (getattr(torch, "Event", None), getattr(torch, "Stream", None)):  # the generic C classes
            if cls is not None and cls.__dict__.get("query") is not None:
                targets.append((cls, "query", "generic " + ("event" if cls is torch.Event else "stream")))
        for cls, attr, what in targets:
            orig = cls.__dict__.get(attr)
            if orig is None:
                continue

            def make(orig, what):
                def query(self):
                    done = orig(self)
                    if done and tracer.running:
                        try:
                            tracer._queried(self, what)
                        except Exception as exc:
                            tracer._stop_on_bug(exc, f"{what} query()")
                    return done
                query.__wrapped__ = orig
                query.__doc__ = orig.__doc__
                return query

            if _set_type_attr(cls, attr, make(orig, what)):
                self._patched.append((cls, attr, orig))
        self._patch_host_reads()
        self._patch_mem_pools()
        self._patch_outside_dispatch()
        self._patch_backward()
        self._patch_stream_creation()
        self._patch_tensor_data()
        self._patch_blind_spots()

    def _patch_tensor_data(self) -> None:
        """``torch.tensor(data, device="cuda")`` and ``torch.as_tensor``: their copy to the device runs where the
        dispatch mode does not look; the values of a small integer tensor made so are known from ``data``."""
        tracer = self
        for name in ("tensor", "as_tensor"):
            orig = getattr(torch, name, None)
            if orig is None:
                continue

            def make(orig):
                def factory(data, *a, **k):
                    out = orig(data, *a, **k)
                    if tracer.tracing and out is not data and out.__class__ is _Tensor and out.is_cuda:
                        try:
                            tracer.index_values.learn_data(out, data)
                        except Exception as exc:
                            tracer._stop_on_bug(exc, "torch.tensor")
                    return out
                factory.__wrapped__ = orig
                factory.__doc__ = orig.__doc__
                return factory

            self._patched.append((torch, name, orig))
            setattr(torch, name, make(orig))

    def _queried(self, obj, what: str) -> None:
        """A ``query()`` of an event or stream returned True: the host has waited for it."""
        if what.endswith("event"):
            h = getattr(obj, "cuda_event", 0) if what == "event" else \
                (obj.event_id if obj.device.type == "cuda" else 0)
            if h:
                self._emit((E.EVENT_SYNC, h, self.stacks.capture(self.buffer.events, 2)))
        elif what == "stream" or obj.device_type == _CUDA_TYPE:
            dev, handle = _stream_key(obj)
            self._emit((E.STREAM_SYNC, self.agent(dev, handle), self.stacks.capture(self.buffer.events, 2)))

    def _patch_host_reads(self) -> None:
        """``Tensor.tolist()`` and ``Tensor.numpy()`` (also reached by ``np.asarray(t)``) launch no aten op.

        ``tolist()`` reads a pinned tensor's memory when it is called. ``numpy()`` only makes a view, read later
        through the array (:meth:`_open_view`): its reads and writes are seen when they happen, and the view also
        counts as one host read at the latest moment the program can read through it, when the array (and every
        view of it) is gone, or when tracing stops. So ``np.asarray(t).sum()`` before a synchronization races, and
        a view made while a copy runs and read after ``event.synchronize()`` (vLLM's asynchronous outputs) does
        not."""
        tracer = self
        for attr in ("tolist", "numpy"):
            orig = getattr(torch.Tensor, attr, None)
            if orig is None:
                continue

            def make(orig, name):
                def read(self, *a, **k):
                    out = orig(self, *a, **k)  # a call that raises read nothing
                    if tracer.pinned and tracer.tracing and self.is_cpu:
                        try:
                            if name == "Tensor.numpy":
                                out = tracer._open_view(self, out)
                            else:
                                tracer._host_read(self, name)
                        except Exception as exc:
                            tracer._stop_on_bug(exc, name)
                    return out
                read.__wrapped__ = orig
                read.__doc__ = orig.__doc__
                return read

            self._patched.append((torch.Tensor, attr, torch.Tensor.__dict__.get(attr)))
            setattr(torch.Tensor, attr, make(orig, f"Tensor.{attr}"))
        serialization = getattr(torch, "serialization", None)
        orig_save = getattr(serialization, "save", None)
        if orig_save is not None:
            def save(obj, *a, **k):
                """``torch.save`` reads the pinned tensors it serializes (in C++, without an aten op)."""
                if tracer.pinned and tracer.tracing and tracer.in_scope:
                    try:
                        for t in _tensors_in(obj):
                            if t.is_cpu:
                                tracer._host_read(t, "torch.save")
                    except Exception as exc:
                        tracer._stop_on_bug(exc, "torch.save")
                return orig_save(obj, *a, **k)
            save.__wrapped__ = orig_save
            for owner in (torch, serialization):
                if getattr(owner, "save", None) is orig_save:
                    self._patched.append((owner, "save", orig_save))
                    owner.save = save

    def _host_read(self, t, name: str) -> None:
        r = self._range_in(t, E.PINNED)
        if r is not None:
            self._emit((E.OP, E.HOST, name, (r,), (), self.stacks.capture(self.buffer.events, 2), self.ctx, 0))

    def _internal_error(self, exc, func):
        """An exception escaped the dispatch: None if the op itself raised it, else (whether the op ran, its
        output) after :meth:`_stop_on_bug` (a bug of streamsan's must not break the program). Which it is: the
        innermost streamsan frame of the traceback stands on a line that calls the op, or not; an op that ran
        left its result in that frame's ``out``."""
        import linecache

        tb, own = exc.__traceback__, None
        while tb is not None:
            if is_own_file(tb.tb_frame.f_code.co_filename):
                own = tb
            tb = tb.tb_next
        line = linecache.getline(own.tb_frame.f_code.co_filename, own.tb_lineno) if own is not None else ""
        if own is None or "func(*args" in line or "call(*args" in line:
            return None
        self._stop_on_bug(exc, str(func))
        return "out" in own.tb_frame.f_locals, own.tb_frame.f_locals.get("out")

    @property
    def stopped_on_bug(self) -> bool:
        """Whether tracing stopped for good after a bug of streamsan's own (:meth:`_stop_on_bug`)."""
        return "internal" in self._noted

    def _stop_on_bug(self, exc, where: str) -> None:
        """A bug of streamsan's own surfaced at ``where``: stop tracing, log the traceback, say so in the report."""
        import logging

        self.tracing = False
        logging.getLogger("streamsan").error("internal error while tracing %s", where, exc_info=exc)
        self._note_once("internal", f"{E.TRACING_STOPPED} at {where} ({type(exc).__name__}: {exc}); findings "
                                    f"cover what ran before it")

    def _engine_stack(self, events) -> int:
        """The stack of an op run by PyTorch's autograd engine in a thread without Python frames: the backward
        node it runs, then where ``backward()`` was called. In an engine thread between nodes, the op is a callback
        queued for the end of the backward pass (DDP's reducer copying reduced buckets into ``.grad``): named so."""
        node = _current_autograd_node() if _current_autograd_node is not None else None
        site = self._backward_site
        if node is None:
            if not site or _get_ident() not in self._engine_threads:
                return 0
            return self.stacks.synthetic(events, ("autograd", ENGINE_CALLBACK, site),
                                         ((ENGINE_FRAME, 0, ENGINE_CALLBACK),) + site)
        self._engine_threads.add(_get_ident())
        name = node.name()
        sid = self.stacks.synthetic(events, ("autograd", name, site), ((ENGINE_FRAME, 0, name),) + site)
        self._engine_sids.add(sid)
        return sid

    def _open_view(self, t, array):
        """``t.numpy()`` made ``array``: the array to hand out. Over pinned memory, a :mod:`.pinned_numpy` view,
        whose accesses are seen when they happen (made before the copies that use the memory, as vLLM's input
        batches make theirs, it sees them all the same); such a view is also read, at the latest, when it is gone
        (for what the view cannot see: its memory handed to native code; views made by ``np.asarray(t)`` are plain
        arrays over it)."""
        r = self._range_in(t, E.PINNED)
        if r is None:
            return array
        array = array.view(pinned_class())
        read = (E.OP, E.HOST, "Tensor.numpy", (r,), (), self.stacks.capture(self.buffer.events, 2), self.ctx, 0)
        try:
            ref = weakref.ref(array, self._close_view)
        except TypeError:  # not an ndarray after all: read now
            self._emit(read)
            return array
        self.views.opened[id(ref)] = (ref, read)  # the reference lives as long as its entry (arrays are unhashable)
        return array

    def _close_view(self, ref) -> None:
        entry = self.views.opened.pop(id(ref), None)
        if entry is not None and self.running:
            self._emit(entry[1])

    def pinned_range(self, arr):
        """The PINNED range of a NumPy array over a pinned block this tracer knows (:mod:`.pinned_numpy`)."""
        if not arr.size:
            return None
        ptr = arr.__array_interface__["data"][0]
        for base, size in tuple(self.pinned.items()):  # (other threads may pin meanwhile)
            if base <= ptr < base + size:
                return strided_range(E.PINNED, ptr, arr.shape, arr.strides, arr.itemsize)
        return None

    def host_op(self, name, reads, writes) -> None:
        """A host access through a :mod:`.pinned_numpy` view, when it happens."""
        if self.tracing and self.in_scope and (reads or writes):
            if writes and self.staged.kept:
                self.staged.forget(writes)
            self._emit((E.OP, E.HOST, name, tuple(reads), tuple(writes), self.stacks.capture(self.buffer.events, 2),
                        self.ctx, 0))

    def _patch_backward(self) -> None:
        """Remember where ``backward()`` / ``torch.autograd.grad()`` is called, for the stacks of the backward ops
        the autograd engine runs in its own threads."""
        tracer = self
        autograd = getattr(torch, "autograd", None)
        for attr in ("backward", "grad"):
            orig = getattr(autograd, attr, None)
            if orig is None:
                continue

            def make(orig):
                def call(*a, **k):
                    if tracer.tracing:
                        tracer._backward_site = tracer.stacks.frames_here(1)
                    return orig(*a, **k)
                call.__wrapped__ = orig
                call.__doc__ = orig.__doc__
                return call

            self._patched.append((autograd, attr, orig))
            setattr(autograd, attr, make(orig))

    def _patch_stream_creation(self) -> None:
        """``torch.cuda.Stream()``: a new stream is named after what its creating line assigns it to
        (:mod:`.naming`). Wrapping an existing stream (``stream_id=``, as ``current_stream()`` does) is no
        creation."""
        cls = getattr(getattr(torch, "cuda", None), "Stream", None)
        orig = vars(cls).get("__new__") if cls is not None else None
        if orig is None:
            return
        make = orig.__func__ if isinstance(orig, staticmethod) else orig
        tracer = self

        def __new__(klass, *a, **k):
            stream = make(klass, *a, **k)
            if tracer.tracing and "stream_id" not in k:
                try:
                    name = caller_name()
                    if name:
                        device, handle = _stream_key(stream)
                        tracer.streams.name_created(device, handle, name)
                except Exception as exc:
                    tracer._stop_on_bug(exc, "torch.cuda.Stream()")
            return stream
        __new__.__wrapped__ = make
        __new__.__doc__ = make.__doc__

        self._patched.append((cls, "__new__", orig))
        cls.__new__ = staticmethod(__new__)

    def _patch_mem_pools(self) -> None:
        """``torch.cuda.use_mem_pool(pool)``: the calling thread's allocations inside go to a private pool, and
        their blocks go back to it when freed, for allocations routed there only: the ALLOC events made meanwhile
        carry the pool (a small number per pool), so that the analyzer knows which allocations can reuse them."""
        cuda = getattr(torch, "cuda", None)
        memory = getattr(cuda, "memory", None)
        orig = getattr(memory, "use_mem_pool", None)
        if orig is None:
            return
        routing = self.pool_of_thread
        numbers: dict = {}

        def use_mem_pool(pool, *args, **kwargs):
            cm = orig(pool, *args, **kwargs)
            try:
                number = numbers.setdefault(pool.id, len(numbers) + 1)
            except Exception:  # not a MemPool: the original raises, or routes nowhere streamsan can name
                return cm
            return _RoutedToPool(cm, routing, number)
        use_mem_pool.__wrapped__ = orig
        use_mem_pool.__doc__ = orig.__doc__
        for mod in (memory, cuda):
            if getattr(mod, "use_mem_pool", None) is orig:
                self._patched.append((mod, "use_mem_pool", orig))
                mod.use_mem_pool = use_mem_pool

    def _patch_outside_dispatch(self) -> None:
        """Two things libraries do where a dispatch mode cannot see them (FSDP does both):

        * ``record_stream`` under ``no_dispatch()``: handled here when the mode did not see the call;
        * ``UntypedStorage.resize_`` (not an aten op): allocating a storage's block (sized here, on the current
          stream), copying the old bytes over (a read and a write on that stream) and freeing the old block."""
        tracer = self
        orig_record = torch.Tensor.__dict__.get("record_stream") or getattr(torch.Tensor, "record_stream", None)
        if orig_record is not None:
            def record_stream(t, stream):
                tracer._record_stream_seen = None
                out = orig_record(t, stream)
                if tracer.tracing and tracer.in_scope and tracer._record_stream_seen != _get_ident():
                    try:
                        tracer._record_stream((t, stream))
                    except Exception as exc:
                        tracer._stop_on_bug(exc, "Tensor.record_stream")
                return out
            record_stream.__wrapped__ = orig_record
            record_stream.__doc__ = orig_record.__doc__
            self._patched.append((torch.Tensor, "record_stream", torch.Tensor.__dict__.get("record_stream")))
            torch.Tensor.record_stream = record_stream
        storage = getattr(torch, "UntypedStorage", None)
        orig_resize = getattr(storage, "resize_", None)
        if orig_resize is not None:
            def resize_(st, size):
                if not (tracer.tracing and tracer.in_scope and st.is_cuda):
                    return orig_resize(st, size)
                return tracer._storage_resize(orig_resize, st, size)
            resize_.__wrapped__ = orig_resize
            resize_.__doc__ = orig_resize.__doc__
            self._patched.append((storage, "resize_", storage.__dict__.get("resize_")))
            storage.resize_ = resize_

    def _storage_resize(self, orig, st, size):
        try:
            dev = st.device.index
            old_ptr, old_n = st.data_ptr(), st.nbytes()
            stack = self.stacks.outside(self.buffer.events)
        except Exception as exc:
            self._stop_on_bug(exc, "UntypedStorage.resize_")
            return orig(st, size)
        out, a, evs, mark = self._run_inside(orig, (st, size), {}, dev, stack)
        try:
            self._place_resize(evs, mark, st, a, dev, old_ptr, old_n, stack)
            self._commit(evs)
        except Exception as exc:
            self._stop_on_bug(exc, "UntypedStorage.resize_")
        return out

    def _place_resize(self, evs, mark, st, a, dev, old_ptr, old_n, stack) -> None:
        """The events of a storage resize: its new block's allocation (sized), the copy of the old bytes on the
        current stream, then the old block's free."""
        new_ptr, new_n = st.data_ptr(), st.nbytes()
        inner = evs[mark:]
        del evs[mark:]
        allocs = [ev for ev in inner if ev[0] == E.ALLOC]
        if new_ptr != old_ptr and _ALLOCATOR.unreported is not False and self._allocations_unreported():
            # (the allocator reports neither the new block nor the old one's free: the resize does both)
            if _ALLOCATOR.resized(self, old_ptr):
                inner.append((E.FREE, dev, old_ptr, 0))
            if new_n:
                allocs = [(E.ALLOC, dev, new_ptr, new_n, a, stack, self.ctx, "storage", E.UNREPORTED_POOL)]
                _ALLOCATOR.watch(self, dev, new_ptr, st)
        for i, ev in enumerate(allocs):
            if ev[2] == new_ptr and ev[3] == 0:
                allocs[i] = (E.ALLOC, ev[1], ev[2], new_n, ev[4], ev[5], ev[6], "storage") + ev[8:]
        evs.extend(allocs)
        keep = min(old_n, new_n)
        if keep and old_ptr != new_ptr:
            evs.append((E.OP, a, "UntypedStorage.resize_", ((dev, old_ptr, keep),), ((dev, new_ptr, keep),),
                        stack, self.ctx, 0))
        evs.extend(ev for ev in inner if ev[0] != E.ALLOC)

    def _note_once(self, key: str, text: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            if self.on_note is not None:
                self.on_note(text)
            else:
                self.buffer.events.append((E.NOTE, "warning", text))

    def _patch_blind_spots(self) -> None:
        """CUDA graphs: ops during capture are recorded into the graph, not run, so their accesses are kept for
        the graph's replays (:meth:`_replay`). torch.compile: its functions run eagerly under the dispatch mode;
        say so once."""
        tracer = self
        graphs = getattr(getattr(torch, "cuda", None), "graphs", None)
        cls = getattr(graphs, "CUDAGraph", None) if graphs is not None else None
        if cls is not None:
            begin, end, replay = (cls.__dict__.get(n) for n in ("capture_begin", "capture_end", "replay"))

            def capture_begin(self, *a, **k):
                tracer._note_once("graph", GRAPH_NOTE)
                tracer.graphs.current = ([], [], tracer.tracing, [])
                tracer.tracing = False
                try:
                    with _DisableTorchDispatch():  # (see graph_replay)
                        out = begin(self, *a, **k)
                    if tracer.graphs.current[2]:
                        dev = _cuda_get_device()
                        tracer.streams.name_unnamed(dev, _cuda_raw_stream(dev), CAPTURE_STREAM)
                    return out
                except BaseException:
                    tracer._end_capture(None)
                    raise

            def capture_end(self, *a, **k):
                try:
                    return end(self, *a, **k)
                finally:
                    tracer._end_capture(self)

            def graph_replay(self, *a, **k):
                """The replay's own op. The ops PyTorch runs itself before a capture begins and before each replay
                (the CUDA generators' seed and offset fills, the same memory for every graph) are its
                bookkeeping, not the program's nor the graph's: unseen, in this thread only."""
                if tracer.tracing and tracer.in_scope:
                    try:
                        tracer._replay(self)
                    except Exception as exc:
                        tracer._stop_on_bug(exc, "CUDAGraph.replay")
                with _DisableTorchDispatch():
                    return replay(self, *a, **k)

            for name, orig, fn in (("capture_begin", begin, capture_begin), ("capture_end", end, capture_end),
                                   ("replay", replay, graph_replay)):
                if orig is not None:
                    fn.__wrapped__ = orig
                    setattr(cls, name, fn)
                    self._patched.append((cls, name, orig))
        compile_fn = getattr(torch, "compile", None)
        if compile_fn is not None:
            def compile(*a, **k):
                tracer._note_once("compile", COMPILE_NOTE)
                _dynamo_safe()
                return compile_fn(*a, **k)

            compile.__wrapped__ = compile_fn
            compile.__doc__ = compile_fn.__doc__
            torch.compile = compile
            self._patched.append((torch, "compile", compile_fn))

    def patch_triton(self, triton_module) -> None:
        """Once the program imports Triton: each launch of a ``@triton.jit`` kernel (``JITFunction.run``) is an op
        on the stream it runs on (:meth:`_triton_launch`)."""
        jit = getattr(getattr(triton_module, "runtime", None), "jit", None)
        cls = getattr(jit, "JITFunction", None)
        orig = cls.__dict__.get("run") if cls is not None else None
        if orig is None or not self.running:
            return
        tracer = self

        def run(kernel, *args, **kwargs):
            out = orig(kernel, *args, **kwargs)
            if not kwargs.get("warmup") and (tracer.tracing and tracer.in_scope or tracer.graphs.current is not None):
                try:
                    tracer._triton_launch(kernel, args, kwargs)
                except Exception as exc:
                    tracer._stop_on_bug(exc, f"triton:{getattr(kernel, '__name__', 'kernel')}")
            return out

        run.__wrapped__ = orig
        cls.run = run
        self._patched.append((cls, "run", orig))

    def _triton_launch(self, kernel, args, kwargs) -> None:
        """A Triton kernel launched with these arguments: its CUDA tensors (or tensor descriptors' base tensors)
        are written if its stores reach them (:mod:`streamsan.tracers.triton`), else read."""
        written = kernel_writes(kernel)
        reads, writes = [], []
        dev = -1
        for name, v in itertools.chain(zip(kernel.arg_names, args), kwargs.items()):
            t = v if isinstance(v, torch.Tensor) else getattr(v, "base", None)
            if not isinstance(t, torch.Tensor) or not t.is_cuda or t.layout is not _STRIDED:
                continue
            r = self._range_in(t, t.get_device())
            if r is not None:
                dev = t.get_device()
                (writes if written is None or name in written else reads).append(r)
        if dev < 0:
            return
        if written is None:
            self._note_once("triton-source", "Triton kernels whose source streamsan cannot read count as writing "
                                             "every tensor argument")
        cap = self.graphs.current
        if not self.tracing:
            if cap is not None:
                self._captured(cap, dev, f"triton:{kernel.__name__}", reads, writes)
            return
        self.saw_cuda = True
        self.index_values.written(writes)
        self._emit((E.OP, self.agent(dev, _cuda_raw_stream(dev)), f"triton:{kernel.__name__}", tuple(reads),
                    tuple(writes), self.stacks.capture(self.buffer.events, 2), self.ctx, 0))

    def _end_capture(self, graph) -> None:
        """A capture ended (``graph`` None: it failed to begin): tracing goes on as before it, and the graph
        keeps the accesses of its captured ops."""
        graphs = self.graphs
        cap, graphs.current = graphs.current, None
        if cap is None:
            return
        reads, writes, was_tracing, nodes = cap
        self.tracing = was_tracing and self.running and not self.stopped_on_bug
        dev = next((r[0] for r in writes + reads if r[0] >= 0), -1)
        if graph is None or dev < 0:
            return
        graphs.accesses.put(graph, dev, reads, writes)
        if self.tracing and len({n[2] if n[0] != E.OP else n[1] for n in nodes}) > 1:  # nodes on several streams
            self._emit((E.GRAPH, tuple(nodes)))

    def _dispatch_captured(self, func, types, args, kwargs):
        """An op while a CUDA graph is captured: on CUDA memory it becomes a node of the graph and does not run
        now, so its accesses are kept for the graph's replays; an op on pinned host memory only runs now, on the
        host."""
        if types and _subclass_kind(types) != _PLAIN:
            return func(*args, **kwargs)
        plan = self.plans.get(id(func)) or self._plan(func)
        if plan.pinning_or_copy:
            self._learn_pinned(plan, args, kwargs)
        out = func(*args, **kwargs)
        if plan.skip:
            return out
        reads, writes = self._args_ranges(plan, args, kwargs)
        if plan.fresh_outputs:
            self._outputs(out, writes)
        cap = self.graphs.current
        dev = next((r[0] for r in reads + writes if r[0] >= 0), -1)
        if cap is not None and dev >= 0:
            self._captured(cap, dev, plan.name, reads, writes)
        elif reads or writes:
            self._emit((E.OP, E.HOST, plan.name, tuple(reads), tuple(writes),
                        self.stacks.capture(self.buffer.events, 3), self.ctx, 0))
        return out

    def _captured(self, cap, dev: int, name: str, reads, writes) -> None:
        """An op captured into the graph ``cap`` on the stream current now: its accesses are the graph's (each
        replay's), and it is one of the graph's nodes."""
        cap[0].extend(reads)
        cap[1].extend(writes)
        ctx = self.ctx or self.buffer.context_id(GRAPH_CONTEXT)
        cap[3].append((E.OP, self.agent(dev, _cuda_raw_stream(dev)), name, tuple(reads), tuple(writes),
                       self.stacks.capture(self.buffer.events, 4), ctx, 0))

    def _replay(self, graph) -> None:
        """``graph.replay()``: one op on the replaying stream that accesses all its captured ops accessed (the
        graph runs as a unit in that stream's order)."""
        acc = self.graphs.accesses.get(graph)
        if acc is None:
            self._note_once("graph-untracked", GRAPH_UNTRACKED)
            return
        dev, reads, writes = acc
        a = self.agent(dev, _cuda_raw_stream(dev))
        self.saw_cuda = True
        self.index_values.written(writes)
        self._emit((E.OP, a, "CUDAGraph.replay", reads, writes, self.stacks.capture(self.buffer.events, 2),
                    self.ctx, 0))

    def _unpatch(self) -> None:
        while self._patched:
            cls, attr, orig = self._patched.pop()
            if orig is None:  # the patch shadowed an inherited attribute
                delattr(cls, attr)
            else:
                _set_type_attr(cls, attr, orig)

    # ------------------------------------------------------------------ ranges
    def _range(self, t):
        """The byte range a tensor's kernel may touch, or None (not CUDA / pinned memory, or empty)."""
        if t.is_cuda:
            return self._range_in(t, t.get_device())
        if t.is_cpu:
            return self._range_in(t, E.PINNED)
        return None

    def _range_in(self, t, space: int):
        try:
            n = t.nbytes
            if n == 0:
                return None
            p = t.data_ptr()
        except RuntimeError:  # sparse and other layouts, tensors without storage
            what = f"{t.layout} tensors" if t.layout is not _STRIDED else "tensors without storage"
            self._note_once(f"layout:{what}", f"{what} are not analyzed (streamsan follows strided memory only)")
            return None
        if space == E.PINNED:
            if not self._is_pinned(t, p):
                return None
        if t.is_contiguous():
            return (space, p, n)
        sizes = t.shape
        strides = t.stride()
        its = t.element_size()
        extent = 1
        dense = True
        for sz, st in zip(sizes, strides):
            if sz > 1:
                if st == 0:
                    dense = False
                extent += (sz - 1) * st
        extent *= its
        if dense and extent == n:
            return (space, p, n)
        return (space, p, extent, (its, tuple(sizes), tuple(strides)))

    def _is_pinned(self, t, p) -> bool:
        pinned = self.pinned
        if not pinned:
            return False
        base = p - t.storage_offset() * t.element_size()
        return base in pinned

    def _learn_pinned(self, plan, args, kwargs) -> None:
        """Before a copy: find out whether its CPU tensors are pinned blocks not seen being created (pinned
        before tracing started, or by a path the tracer does not see)."""
        for pos, name, _w, is_list in plan.tensor_args:
            v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
            if isinstance(v, torch.Tensor) and v.is_cpu and v.layout is _STRIDED and v.nbytes:
                p = v.data_ptr()
                if p and not self._is_pinned(v, p) and v.is_pinned():
                    ev = self._register_pinned(v)
                    if ev is not None:
                        self.buffer.events.append(ev)

    def _known_pinned_block(self, t) -> bool:
        """Whether a pinning op's CPU output is pinned. PyTorch's host allocator hands the same cached blocks out
        again and again, so a block already seen pinned at this address with this size needs no ``is_pinned()``
        query (about 5 us on an H200 host)."""
        st = t.untyped_storage()
        if self.pinned.get(st.data_ptr()) == st.nbytes():
            return True
        return t.is_pinned()

    def _register_pinned(self, t, stack: int = 0) -> tuple | None:
        """A new pinned host block (an op's output): returns its ALLOC event."""
        st = t.untyped_storage()
        base = st.data_ptr()
        size = st.nbytes()
        if size == 0:
            return None
        self.pinned[base] = size
        if self.staged.kept:
            self.staged.forget(((E.PINNED, base, size),))
        return (E.ALLOC, E.PINNED, base, size, E.HOST, stack, self.ctx, describe(t))

    # ------------------------------------------------------------------ dispatch
    def _plan(self, func) -> OpPlan:
        plan = self.plans.get(id(func))
        if plan is None:
            plan = self.plans[id(func)] = OpPlan(func)
        return plan

    def _dispatch(self, func, args, kwargs, plan=None):
        if plan is None:
            plan = self.plans.get(id(func)) or self._plan(func)
        if kwargs and kwargs.get("pin_memory"):
            return self._dispatch_pinning(func, plan, args, kwargs)
        if plan.skip:
            if not plan.fresh_outputs:
                if plan.record_stream:
                    self._record_stream(args)
                    self._record_stream_seen = _get_ident()
                return plan.call(*args, **kwargs)
            evs = self.buffer.events
            mark = len(evs)
            out = plan.call(*args, **kwargs)
            if self.buffer.events is not evs:  # another thread flushed while the op ran
                evs = self.buffer.events
                mark = 0
            if len(evs) > mark:  # an allocating op that touches no data (empty, empty_like, ...)
                self._fill_alloc_sizes(evs, mark, out)
            elif _ALLOCATOR.unreported is not False:  # (the same, where the allocator does not report them)
                dev = _cuda_device_of(out)
                if dev >= 0 and self._allocations_unreported():
                    self._declare_outputs(evs, mark, out, dev, self.agent(dev, _cuda_raw_stream(dev)),
                                          self.stacks.outside(evs), self.ctx)
            return out
        if plan.pinning_or_copy:
            if plan.pinning or _maybe_pinned_output(plan, args, kwargs):
                return self._dispatch_pinning(func, plan, args, kwargs)
            self._learn_pinned(plan, args, kwargs)
        reads = []
        writes = []
        dev = -1
        cpu = cpu_r = None
        cpu_written = False
        rng = self._range_in
        nargs = len(args)
        targs = plan.tensor_args
        if plan.training_args is not None:
            at = plan.training_args[0]
            if (args[at] if at < nargs else kwargs.get("training")) is True:
                targs = plan.training_args[1]
        for pos, name, is_write, is_list in targs:
            v = args[pos] if 0 <= pos < nargs else kwargs.get(name)
            if v is None:
                continue
            if is_list:
                if v and isinstance(v[0], (list, tuple)):
                    v = [t for sub in v for t in sub]
                for t in v:
                    if t is None:
                        continue
                    if t.is_cuda:
                        dev = t.get_device()
                        r = rng(t, dev)
                    elif t.is_cpu and self.pinned:
                        r = rng(t, E.PINNED)
                        if r is not None and is_write and self.staged.kept:
                            self.staged.forget((r,))
                    else:
                        continue
                    if r is not None:
                        (writes if is_write else reads).append(r)
                continue
            if not isinstance(v, _Tensor):
                continue
            if v.is_cuda:
                d = v.get_device()
                if dev < 0 or (plan.is_copy and not is_write):
                    dev = d
                try:  # the common case, contiguous, inline; everything else in _range_in
                    n = v.nbytes
                    r = (d, v.data_ptr(), n) if n and v.is_contiguous() else rng(v, d)
                except RuntimeError:
                    r = rng(v, d)
            elif v.is_cpu:
                cpu = v
                cpu_written = is_write
                r = cpu_r = rng(v, E.PINNED) if self.pinned else None
            else:
                continue
            if r is not None:
                (writes if is_write else reads).append(r)
        if plan.indexed is not None and dev >= 0:
            self._index_rows(plan, args, kwargs, reads, writes)
        if dev < 0:
            if not plan.fresh_outputs:
                if not reads and not writes:
                    return plan.call(*args, **kwargs)
                return self._host_op(func, plan, args, kwargs, reads, writes)
            # a factory or a host-to-device copy naming its device, or a ``*_like`` / ``new_*`` factory of a CUDA
            # tensor (its argument not an access): known now, so the op has its own events while it runs
            dev = _cuda_target(kwargs)
            if dev < 0:
                dev = _cuda_device_among(args)
        evs = self.buffer.events
        ctx = self.ctx
        mine = None
        single = 0  # the data pointer of a single contiguous CUDA output
        flags = 0
        if plan.is_copy and cpu is not None:
            flags = self._copy_flags(cpu, cpu_written, args, kwargs)
        if dev >= 0:
            a = self.agent_of.get((dev, _cuda_raw_stream(dev))) or self.agent(dev, _cuda_raw_stream(dev))
            stack = self.stacks.outside(evs)
            me = _get_ident()
            mine = self.op_agent = self.buffer.ops_of_threads[me] = (dev, a, stack, ctx, me, _OpEvents())
            if cpu_r is not None and not cpu_written and not flags:  # an asynchronous copy out of pinned memory
                self._staged_write(evs, cpu, cpu_r, stack, ctx)
        mark = len(evs)
        try:
            out = plan.call(*args, **kwargs)
        finally:
            if mine is not None:
                self.buffer.ops_of_threads.pop(mine[4], None)
                if self.op_agent is mine:
                    self.op_agent = None
        if mine is not None:  # the events this thread fired inside the op, whatever other threads did meanwhile
            evs = mine[5]
            mark = 0
        elif self.buffer.events is not evs:  # another thread flushed while the op ran: all since then is inside it
            evs = self.buffer.events
            mark = 0
        if plan.fresh_outputs:
            if dev < 0:
                dev = _cuda_device_of(out)
                if dev < 0:  # a CPU op with CPU outputs
                    if not reads and not writes:
                        return out
                    if self.staged.kept:
                        self.staged.forget(writes)
                    evs.append((E.OP, E.HOST, plan.name, tuple(reads), tuple(writes), self.stacks.capture(evs, 2),
                                ctx, 0))
                    return out
                a = self.agent(dev, _cuda_raw_stream(dev))  # e.g. an H2D copy or a factory with device=cuda
                stack = self.stacks.outside(evs)
            if out.__class__ is _Tensor and out.is_cuda:  # the common case, one plain tensor, inline
                try:
                    n = out.nbytes
                    if n and out.is_contiguous():
                        single = out.data_ptr()
                        writes.append((out.get_device(), single, n))
                    else:
                        self._outputs(out, writes)
                except RuntimeError:
                    self._outputs(out, writes)
            else:
                self._outputs(out, writes)
            if _ALLOCATOR.unreported is not False and self._allocations_unreported():
                self._declare_outputs(evs, mark, out, dev, a, stack, ctx)
        self.saw_cuda = True
        if cpu_written and self.staged.kept:
            self.staged.forget(writes)
        known = self.index_values
        if known.spans:
            self._values_after(plan, args, kwargs, out, () if plan.is_copy and cpu is not None else reads, writes)
        if cpu is not None and plan.is_copy and not cpu_written:  # a copy from the host: index values seen
            dst = out if plan.fresh_outputs else args[0] if args else kwargs.get("self")
            if isinstance(dst, _Tensor) and dst.is_cuda:
                known.learn_copy(dst, cpu)
        elif plan.arange and out.is_cuda:
            known.learn_arange(out, args, kwargs)
        op = (_OP, a, plan.name, tuple(reads), tuple(writes), stack, ctx, flags)
        inner = len(evs) - mark
        if not inner:
            evs.append(op)
        elif inner == 1 and single and evs[mark][0] == _ALLOC and evs[mark][2] == single and not evs[mark][3]:
            # the common case: the op allocated its one contiguous output
            ev = evs[mark]
            evs[mark] = (_ALLOC, ev[1], single, out.untyped_storage().nbytes(), ev[4], ev[5] or stack, ev[6] or ctx,
                         describe(out)) + ev[8:]
            evs.append(op)
        else:
            self._place(evs, mark, op, out if plan.fresh_outputs else None, collective=plan.collective)
        if self._engine_threads and _get_ident() in self._engine_threads:
            self._engine_op(evs, plan, args, kwargs, out, a, stack)
        if mine is not None:
            buf = self.buffer.events
            buf.extend(evs)
            evs = buf
        if len(evs) >= self.buffer.batch:
            self.buffer.flush()
        return out

    def _values_after(self, plan, args, kwargs, out, reads, writes) -> None:
        """An op that may read or write known index values ran (both tracers): what an op of
        :data:`.indices.DERIVED` made from them is known too; what any op overwrote is not."""
        known = self.index_values
        spans = known.spans
        result = None
        if plan.derives and any(s[0] == r[0] and s[1] < r[1] + r[2] and r[1] < s[2]
                                for r in itertools.chain(reads, writes) for s in spans):
            result = known.derive(plan, args, kwargs or {})
        known.written(writes)
        if (result is not None and isinstance(out, _Tensor) and out.is_cuda and out.dtype in INDEX_DTYPES
                and isinstance(result, _Tensor) and result.numel() == out.numel() and out.is_contiguous()):
            known.learn(out, flat_values(result))

    def _index_rows(self, plan, args, kwargs, reads, writes) -> None:
        """An index-addressed op whose indices' values are known touches only the rows they name: its indexed
        tensor's whole range (in ``reads`` or ``writes``) becomes those rows' ranges."""
        found = indexed_rows(plan.indexed, args, kwargs, self.index_values)
        if found is None:
            return
        t, rows = found
        whole = self._range_in(t, t.get_device())
        for ranges in (writes, reads):
            for i, r in enumerate(ranges):
                if r == whole:
                    ranges[i:i + 1] = rows
                    return

    def _engine_op(self, evs, plan, args, kwargs, out, a, stack) -> None:
        """An op in a thread of PyTorch's autograd engine. The engine hands the gradients a backward node makes
        to the nodes that consume them, and when a consumer runs on another stream it records the gradient on that
        stream, in C++ (``record_stream``, unseen by a dispatch mode). Gradients are what the engine's own
        backward formulas make (ops without Python frames: not the tensors pack / unpack hooks or the forward
        pass made), so: the outputs of such ops are remembered as gradients, and each gradient read by an op of a
        backward node (a formula, or a custom ``autograd.Function``'s ``backward``) is recorded on that op's stream.
        Ops of hooks (``Tensor.register_hook``, post-accumulate-grad hooks) are not the node's: a hook that reads a
        gradient on a stream of its own gets no record from the engine (pipeline stages' boundary copies, FSDP-like
        gradient reduction), so a free of that gradient without ``record_stream`` is the program's to answer for."""
        grads = self._engine_grads
        own = stack in self._engine_sids
        if plan.fresh_outputs and own:
            for t in _plain_tensors(out):
                if t.is_cuda:
                    grads.add(t.untyped_storage().data_ptr())
        if not grads:
            return
        node = None  # (whether the op is a node's: known at the first gradient it reads)
        nargs = len(args)
        for pos, name, is_write, _is_list in plan.tensor_args:
            if is_write:
                continue
            for t in _plain_tensors(args[pos] if 0 <= pos < nargs else kwargs.get(name)):
                if t.is_cuda and t.layout is _STRIDED:
                    base = t.untyped_storage().data_ptr()
                    if base in grads:
                        if node is None:
                            node = own or _in_custom_backward()
                        if node:
                            evs.append((E.RECORD_STREAM, t.get_device(), base, a, stack))

    def _staged_write(self, evs, t, r, stack, ctx) -> None:
        """Before an asynchronous copy out of pinned memory: the host's writes to it that no traced call showed
        since the block's previous such copy (:mod:`streamsan.tracers.staging`), as a host write."""
        base = r[1] - t.storage_offset() * t.element_size()
        written = self.staged.check(r, base, t if t._base is None else t._base, t.element_size())
        if written is not None:
            evs.append((E.OP, E.HOST, WRITE_SEEN, (), (written,), stack, ctx, 0))

    def _copy_flags(self, cpu, cpu_written, args, kwargs) -> int:
        """OP_BLOCKING for copies the host waits for: into pageable memory (CUDA returns once it is done, even
        when non_blocking), and blocking copies (their stream synchronization is also reported by PyTorch)."""
        p = cpu.data_ptr() if cpu.layout is _STRIDED else 0
        if not p:
            return 0
        pinned = self._is_pinned(cpu, p)
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
        if not non_blocking or (cpu_written and not pinned):
            return E.OP_BLOCKING
        return 0

    def _outputs(self, out, writes) -> None:
        if isinstance(out, torch.Tensor):
            r = self._range(out)
            if r is not None:
                writes.append(r)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    r = self._range(t)
                    if r is not None:
                        writes.append(r)

    @staticmethod
    def _output_blocks(out, storages=None) -> dict:
        """storage pointer -> (bytes, description) of an op's CUDA outputs (``storages``, a dict: filled with
        storage pointer -> the storage)."""
        sizes = {}
        if out is not None:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    try:
                        st = t.untyped_storage()
                        ptr = st.data_ptr()
                        sizes[ptr] = (st.nbytes(), describe(t))
                    except RuntimeError:  # sparse, or a subclass without storage: no single block
                        continue
                    if storages is not None:
                        storages[ptr] = st
        return sizes

    def _allocations_unreported(self) -> bool:
        """Whether the allocator reports no allocations (:class:`AllocatorBackend`), learnt once CUDA is up."""
        if _ALLOCATOR.unreported is None and _ALLOCATOR.learn():
            self._note_once("unreported-allocs", UNREPORTED_NOTE.format(_ALLOCATOR.name))
        return bool(_ALLOCATOR.unreported)

    def _declare_outputs(self, evs, mark, out, dev, agent, stack, ctx) -> None:
        """Where the allocator reports no allocations: an op's new CUDA outputs, as allocations on its stream placed
        before it (``E.UNREPORTED_POOL``), each freed when its storage dies (:meth:`AllocatorBackend.watch`)."""
        storages = {}
        blocks = self._output_blocks(out, storages)
        evs[mark:mark] = [(E.ALLOC, dev, base, size, agent, stack, ctx, what, E.UNREPORTED_POOL)
                          for base, (size, what) in blocks.items() if size]
        for base, (size, _what) in blocks.items():
            if size:
                _ALLOCATOR.watch(self, dev, base, storages[base])

    def _fill_alloc_sizes(self, evs, mark, out) -> None:
        """Size the allocations an op without accesses made (``empty``...) and give them the op's stack."""
        sizes = self._output_blocks(out)
        stack = 0
        for i in range(mark, len(evs)):
            ev = evs[i]
            if ev[0] == E.ALLOC and ev[3] == 0 and ev[2] in sizes:
                size, what = sizes[ev[2]]
                if not stack:
                    stack = self.stacks.outside(evs)  # (called from C too)
                evs[i] = (E.ALLOC, ev[1], ev[2], size, ev[4], ev[5] or stack, ev[6], what) + ev[8:]

    def _place(self, evs, mark, op, out, pre=(), collective: bool = False) -> None:
        """Reorder the events fired inside an op: its allocations (sized from its outputs) first, with the frees of
        the temporaries it allocated and freed inside (in their order: a block may be handed out again within the
        op), then the barrier its kernel waits for (:func:`_kernel_position`), then the op, then everything else
        (a blocking copy's synchronization, the pinned allocator's event record, frees of memory allocated
        before). A collective is moved to the stream it runs on."""
        if self.staged.kept:
            self.staged.forget(op[4])
        sizes = self._output_blocks(out)
        if not pre and all(ev[0] == E.ALLOC for ev in evs[mark:]):  # the common case: only allocations
            for i in range(mark, len(evs)):
                ev = evs[i]
                if ev[3] == 0 and ev[2] in sizes:
                    size, what = sizes[ev[2]]
                    evs[i] = (E.ALLOC, ev[1], ev[2], size, ev[4], ev[5] or op[5], ev[6] or op[6], what) + ev[8:]
            evs.append(op)
            return
        inner = evs[mark:]
        del evs[mark:]
        evs.extend(pre)
        rest = []
        temporaries = set()  # (space, pointer) of the blocks allocated inside the op and not freed yet
        for ev in inner:
            if ev[0] == E.ALLOC:
                if ev[3] == 0 and ev[2] in sizes:
                    size, what = sizes[ev[2]]
                    ev = (E.ALLOC, ev[1], ev[2], size, ev[4], ev[5] or op[5], ev[6] or op[6], what) + ev[8:]
                evs.append(ev)
                temporaries.add((ev[1], ev[2]))
            elif ev[0] == E.FREE and (ev[1], ev[2]) in temporaries:
                temporaries.discard((ev[1], ev[2]))
                evs.append(ev)
            elif ev[0] in (E.STREAM, E.DEF_STACK, E.DEF_CONTEXT):
                evs.append(ev)
            else:
                rest.append(ev)
        barrier, agent = _kernel_position(rest, op[1], collective)
        kept_alive = ()
        if agent != op[1]:
            op = (op[0], agent) + op[2:]
            self._name_collective_stream(evs, agent)
            kept_alive = _kept_alive_for(op)
        evs.extend(rest[:barrier])
        evs.append(op)
        evs.extend(kept_alive)
        evs.extend(rest[barrier:])

    def _name_collective_stream(self, evs, agent: int) -> None:
        """Reports call the stream a collective ran on "collective stream" (it is the library's own)."""
        if agent in self.streams.collective:
            return
        self.streams.collective.add(agent)
        for key, a in self.agent_of.items():
            if a == agent:
                evs.append((E.STREAM, agent, key[0], key[1], self.streams.flags_of.get(key, 0), "collective stream"))
                return

    def _run_inside(self, func, args, kwargs, dev: int, stack: int):
        """Run an op; on a CUDA device (``dev`` >= 0) its current stream is the agent of the events fired inside
        the op (allocations, a copy's events). Returns (output, agent, the event list, where the events fired
        inside start): the op's own list (:class:`_OpEvents`: the events its thread fired inside it, whatever other
        threads did meanwhile), to place the op in and :meth:`_commit`. (``_dispatch`` spells this out: it is the
        hot path.)"""
        me = _get_ident()
        if dev >= 0:
            a = self.agent(dev, _cuda_raw_stream(dev))
            mine = self.op_agent = self.buffer.ops_of_threads[me] = (dev, a, stack, self.ctx, me, _OpEvents())
        else:  # a host op (pinning): its own list all the same, or other threads' events would count as inside it
            a = E.HOST
            mine = self.buffer.ops_of_threads[me] = (-1, a, stack, self.ctx, me, _OpEvents())
        try:
            out = func(*args, **kwargs)
        finally:
            self.buffer.ops_of_threads.pop(me, None)
            if self.op_agent is mine:
                self.op_agent = None
        return out, a, mine[5], 0

    def _commit(self, evs) -> None:
        """Hand an op's own event list (:class:`_OpEvents`, once its events are placed) to the buffer, at once."""
        if evs.__class__ is _OpEvents and evs:
            self.buffer.events.extend(evs)

    def _dispatch_wrapped(self, func, args, kwargs):
        """An op on wrapper subclasses (DTensor, ...): the subclass runs it on its inner tensors where the dispatch
        mode does not look, so the op's accesses are the inner tensors', on the current stream of their device."""
        plan = self.plans.get(id(func)) or self._plan(func)
        reads, writes = [], []
        dev = -1
        for pos, name, is_write, _is_list in plan.tensor_args:
            v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
            for t in _plain_tensors(v):
                if t.is_cuda and dev < 0:
                    dev = t.get_device()
                r = None if plan.skip else self._range(t)
                if r is not None:
                    (writes if is_write else reads).append(r)
        if dev < 0:
            dev = _cuda_target(kwargs)
        stack = self.stacks.capture(self.buffer.events, 2)
        out, a, evs, mark = self._run_inside(func, args, kwargs, dev, stack)
        plain = list(_plain_tensors(out))
        if plan.skip:
            self._fill_alloc_sizes(evs, mark, plain)
            self._commit(evs)
            return out
        if plan.fresh_outputs:
            self._outputs(plain, writes)
        if a == E.HOST:  # no CUDA tensor among the arguments it reads (zeros_like reads none): its outputs'
            dev = next((t.get_device() for t in plain if t.is_cuda), -1)
            if dev < 0:
                if reads or writes:  # pinned host memory only
                    if self.staged.kept:
                        self.staged.forget(writes)
                    evs.append((E.OP, E.HOST, plan.name, tuple(reads), tuple(writes), stack, self.ctx, 0))
                self._commit(evs)
                return out
            a = self.agent(dev, _cuda_raw_stream(dev))
        self.saw_cuda = True
        self.index_values.written(writes)
        self._place(evs, mark, (E.OP, a, plan.name, tuple(reads), tuple(writes), stack, self.ctx, 0),
                    plain if plan.fresh_outputs else None, collective=plan.collective)
        self._commit(evs)
        return out

    def _host_op(self, func, plan, args, kwargs, reads, writes):
        """An op on CPU tensors that touches pinned memory: a host access."""
        stack = self.stacks.capture(self.buffer.events, 3)
        out = func(*args, **kwargs)
        if plan.fresh_outputs:
            self._outputs(out, writes)
        if self.staged.kept:
            self.staged.forget(writes)
        evs = self.buffer.events
        evs.append((E.OP, E.HOST, plan.name, tuple(reads), tuple(writes), stack, self.ctx, 0))
        if len(evs) >= self.buffer.batch:  # (ops of other threads still running see the new list)
            self.buffer.flush()
        return out

    def _dispatch_pinning(self, func, plan, args, kwargs):
        """Ops whose output may be new pinned memory: pin_memory(), and non-blocking device-to-host copies.
        The pinned block is declared (ALLOC) before the op that fills it."""
        dev = -1
        for pos, name, _w, is_list in plan.tensor_args:
            v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
            if isinstance(v, torch.Tensor) and v.is_cuda:
                dev = v.get_device()
        stack = self.stacks.outside(self.buffer.events)
        if dev >= 0:
            self.saw_cuda = True
        out, a, evs, mark = self._run_inside(func, args, kwargs, dev, stack)
        pre = []
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_cpu and t.layout is _STRIDED and t.nbytes and \
                    self._known_pinned_block(t):
                ev = self._register_pinned(t, stack)
                if ev is not None:
                    pre.append(ev)
        if plan.skip:  # empty(..., pin_memory=True): a new block, no access
            evs.extend(pre)
            self._commit(evs)
            return out
        reads, writes = self._args_ranges(plan, args, kwargs)
        self._outputs(out, writes)
        op = (E.OP, a, plan.name, tuple(reads), tuple(writes), stack, self.ctx, 0)
        self._place(evs, mark, op, out, pre)
        self._commit(evs)
        return out

    def _run_python_kernel(self, mode, func, plan, key, dev, args, kwargs):
        """Run an op's Python implementation (its kernel at dispatch ``key``; ``dev``: the CUDA device of its
        tensors, or -1) with the mode on (``mode``: the one whose handler this is), so its ops are traced on the
        streams they run on. Its own work may be invisible (a pybind extension launching kernels, as flash-attn's
        custom ops wrap theirs): unless traced ops inside wrote every tensor the op writes by its schema (a result,
        an ``(a!)`` argument), or, for an op that writes none, traced ops ran inside at all, the op is also one
        access by its schema, on the stream current when it was called."""
        agent = self.agent(dev, _cuda_raw_stream(dev)) if dev >= 0 else E.HOST
        call = functools.partial(func._op_dk, key)  # (no frame of its own: an error inside is the program's)
        buf = self.buffer
        flushed = []  # the batches flushed meanwhile: the first holds the events before the call too
        tap = flushed.append
        buf.consumers.append(tap)
        evs = buf.events
        mark = len(evs)
        try:
            with mode:
                out = call(*args, **kwargs)  # (an error inside is the program's, raised as is)
        finally:
            buf.consumers.remove(tap)
        if not self.tracing:
            return out
        reads, writes = self._args_ranges(plan, args, kwargs)
        self._outputs(out, writes)
        chunks = flushed + [buf.events]
        start = next((i for i, x in enumerate(chunks) if x is evs), None)  # (None: not seen whole: the access)
        if start is not None:
            inner = evs[mark:] + [ev for x in chunks[start + 1:] for ev in x]
            written = [r for ev in inner if ev[0] == E.OP for r in ev[4]]
            if writes and all(any(_covers(w, r) for w in written) for r in writes):
                return out
            if not writes and any(ev[0] == E.OP for ev in inner):
                return out
        if reads or writes:
            self._emit((E.OP, agent, plan.name, tuple(reads), tuple(writes), self.stacks.outside(self.buffer.events),
                        self.ctx, 0))
        return out

    def _args_ranges(self, plan, args, kwargs):
        reads, writes = [], []
        for pos, name, is_write, is_list in plan.tensor_args:
            v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
            for t in (v if is_list else (v,)):
                if isinstance(t, torch.Tensor):
                    r = self._range(t)
                    if r is not None:
                        (writes if is_write else reads).append(r)
        return reads, writes

    def _record_stream(self, args) -> None:
        t, s = args[0], args[1]
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.layout is not _STRIDED:
            return
        dev, handle = _stream_key(s)
        a = self.agent(dev, handle)
        base = t.untyped_storage().data_ptr()
        self._emit((E.RECORD_STREAM, t.get_device(), base, a, self.stacks.outside(self.buffer.events)))


def _kernel_position(inner: list, agent: int, collective: bool) -> tuple[int, int]:
    """(how many of the events fired inside an op happened before its kernel, the agent the kernel runs on).

    Before the kernel: the barrier a cross-device copy enqueues first (an event recorded on the destination's
    stream, then waited for by the op's own stream); for a collective, the hand-off to its communication stream
    (an event recorded on the current stream, then waited for by that stream, where the kernel runs). Everything
    from the first event recorded on the op's own stream on (a copy's completion barrier, the pinned allocator's
    event, a collective's end event) and synchronizations of the host come after the kernel."""
    if collective and len(inner) >= 2:
        rec, wait = inner[0], inner[1]
        if rec[0] == E.EVENT_RECORD and rec[2] == agent and wait[0] == E.EVENT_WAIT and wait[1] == rec[1] \
                and wait[2] != agent:
            return 2, wait[2]
    end = 0
    for i, ev in enumerate(inner):
        kind = ev[0]
        if kind == E.EVENT_WAIT and ev[2] == agent:
            end = i + 1
        elif (kind == E.EVENT_RECORD and ev[2] == agent) or kind not in (E.EVENT_RECORD, E.EVENT_WAIT):
            break
    return end, agent


def _kept_alive_for(op) -> list:
    """A collective on its own stream keeps its tensors' memory from reuse until it has run (ProcessGroupNCCL
    records them on its stream, or, since PyTorch 2.6 or so, holds them in the ``Work`` until ``wait()`` or until
    it has completed): modelled as ``record_stream`` on that stream of every device block the op touches."""
    agent, stack = op[1], op[5]
    return [(E.RECORD_STREAM, r[0], r[1], agent, stack) for r in op[3] + op[4] if r[0] >= 0]  # device memory


ENGINE_CALLBACK = "callback at the end of backward"
COMPILE_NOTE = ("torch.compile: compiled functions run eagerly while streamsan's dispatch mode is active (Dynamo "
                "does not compile under one), so their ops are checked one by one; the program's speed differs")
GRAPH_NOTE = ("CUDA graphs: a replay is checked as one access, on the stream it runs on, of the memory its "
              "captured aten ops and Triton kernels touch, and ops captured on several streams against each other "
              "(the capture's events are the graph's edges); kernels of native extensions captured into a graph "
              "are not seen")
CAPTURE_STREAM = "graph capture stream"  # the name of a capture's stream that has none (torch.cuda.graph's own)
GRAPH_CONTEXT = "captured in a CUDA graph: a race between its nodes happens at every replay"
GRAPH_UNTRACKED = "CUDA graphs: a graph captured while streamsan was not tracing it is replayed unanalyzed"


def _storage_base(t) -> int:
    return t.untyped_storage().data_ptr()


def _maybe_pinned_output(plan, args, kwargs) -> bool:
    """A non-blocking copy from CUDA to the CPU returns pinned memory (``_to_copy`` only)."""
    if plan.name != "aten::_to_copy" or not kwargs.get("non_blocking"):
        return False
    src = args[0] if args else kwargs.get("self")
    dev = kwargs.get("device")
    if not isinstance(src, torch.Tensor) or not src.is_cuda or dev is None:
        return False
    return (dev.type if isinstance(dev, torch.device) else torch.device(dev).type) == "cpu"


def _cuda_target(kwargs) -> int:
    """The CUDA device index an op's ``device`` argument names (the current device for ``cuda``), or -1."""
    d = kwargs.get("device")
    if d is None:
        return -1
    if not isinstance(d, torch.device):
        try:
            d = torch.device(d)
        except (RuntimeError, TypeError):
            return -1
    if d.type != "cuda":
        return -1
    return d.index if d.index is not None else _cuda_get_device()


def _cuda_device_among(values) -> int:
    """The device of the first CUDA tensor among an op's argument values (lists walked), or -1."""
    return next((t.get_device() for v in values for t in _plain_tensors(v) if t.is_cuda), -1)


def _tensors_in(obj, limit: int = 100_000):
    """The tensors in a nest of dicts, lists, tuples and sets (a state dict, a checkpoint), at most ``limit``
    containers and tensors visited."""
    todo = [obj]
    while todo and limit > 0:
        limit -= 1
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo.extend(x)


def _set_type_attr(cls, attr: str, value) -> bool:
    """Set a class attribute, also on a C type that refuses it (``torch.Event`` and ``torch.Stream`` are
    immutable types): there the type's own dict is updated and CPython told that the type changed. Returns
    whether the attribute is set."""
    try:
        setattr(cls, attr, value)
        return True
    except TypeError:
        pass
    try:
        import ctypes
        import gc

        (own,) = [d for d in gc.get_referents(cls.__dict__) if isinstance(d, dict)]
        own[attr] = value
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(cls))
    except (AttributeError, ValueError, OSError):  # not CPython, or a dict it does not expose
        return False
    return cls.__dict__.get(attr) is value


def _stream_key(stream) -> tuple[int, int]:
    """(device index, raw cudaStream_t) of a torch.cuda.Stream or torch.Stream."""
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = getattr(stream, "native_handle", None)
    dev = stream.device_index if hasattr(stream, "device_index") else stream.device.index
    if handle is None:
        cs = torch.cuda.Stream(stream_id=stream.stream_id, device_index=dev, device_type=stream.device_type)
        handle = cs.cuda_stream
    return dev, int(handle)


def _cuda_device_of(out) -> int:
    """The device of an op's first CUDA output tensor, or -1."""
    if isinstance(out, torch.Tensor):
        return out.get_device() if out.is_cuda else -1
    if isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return t.get_device()
    return -1
