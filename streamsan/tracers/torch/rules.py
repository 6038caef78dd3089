"""What an aten op reads and writes: :class:`OpPlan`, derived once per op overload from its schema, and the op
tables for what a schema does not say.

A plan names the tensor arguments the op's kernel touches (written or read), whether its results are new memory
it writes, and which path runs it: the C core (``OpPlan.fast``, kinds ``FAST_*``), the Python dispatch, a
composite kernel run under the mode, or an implementation in Python.
"""

from __future__ import annotations

import functools
import re

import torch

from ..indices import DERIVED, INDEXED_OPS

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
# tests/tracers/torch/test_torch_schema_audit.py checks the list against PyTorch's op database.
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


# OpPlan.fast kinds, what the C core does with an op: nothing (the Python path runs it), call it (no access, no fresh
# output), call it and size its allocations (no access, fresh outputs), trace its accesses
FAST_NONE, FAST_UNTOUCHED, FAST_ALLOCATING, FAST_ACCESSES = 0, 1, 2, 3
# the positions of OpPlan.fast's fields
FAST_FIELDS = {"kind": 0, "call": 1, "name": 2, "tensor_args": 3, "fresh_outputs": 4, "is_copy": 5}
# the positions of the fields of an item of OpPlan.tensor_args (position -1: a keyword-only argument)
ARG_FIELDS = {"position": 0, "name": 1, "is_write": 2, "is_list": 3}


def direct_call(func):
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
    ``call``: what runs the op (:func:`direct_call`). ``fast``: what the C core reads (``streamsan/_ctracer.c``), at
    the positions ``FAST_FIELDS`` names: (kind, call, name, tensor_args, fresh_outputs, is_copy), kind ``FAST_NONE``
    for ops only the Python path handles. Each item of ``tensor_args`` is laid out as ``ARG_FIELDS`` names.
    """

    __slots__ = ("func", "call", "name", "tensor_args", "fresh_outputs", "skip", "metadata_inplace", "is_copy",
                 "pinning", "pinning_or_copy", "record_stream", "collective", "indexed", "arange", "base", "derives",
                 "decompose", "python_kernel", "training_args", "fast")

    def __init__(self, func):
        self.func = func
        self.call = direct_call(func)
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
            kind = FAST_NONE
        elif self.skip:
            kind = FAST_NONE if self.record_stream else FAST_ALLOCATING if self.fresh_outputs else FAST_UNTOUCHED
        else:
            kind = FAST_NONE if self.pinning or self.collective or self.indexed else FAST_ACCESSES
        self.fast = (kind, self.call, self.name, self.tensor_args, self.fresh_outputs, self.is_copy)


def _schema_hides_accesses(schema, base: str) -> bool:
    """Whether an op's accesses cannot be read from its schema: its result aliases an input (``to``, ``reshape``,
    ``contiguous``, ``flatten``...: the input itself, or a copy of it), or it is one of :data:`SCHEMA_HIDES`."""
    return base in SCHEMA_HIDES or any(r.alias_info is not None and not r.alias_info.is_write
                                        for r in schema.returns)


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
