"""The torch tracer's dispatch mode (:class:`TracingMode`) and its Python path: every aten op the C core leaves to
it, as the read and write ranges its plan names, on the stream current at dispatch; and the variants for ops that
may make pinned memory, ops on wrapper subclasses, ops on host memory only, and ops implemented in Python.
"""

from __future__ import annotations

import functools
import itertools
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ... import events as E
from ..indices import INDEX_DTYPES, flat_values, indexed_rows
from ...stacks import is_own_file
from ..staging import host_access
from . import ccore, device
from .allocators import ALLOCATOR, allocations_unreported, declare_outputs
from .cuda_graphs import dispatch_captured
from .engine import engine_op
from .host_memory import known_pinned_block, learn_pinned, register_pinned, staged_write
from .placement import OpEvents, commit, fill_alloc_sizes, place, run_inside
from .tensors import (MEMORYLESS, WRAPPER, args_ranges, cuda_target, describe, device_among, device_of_output,
                      is_pinned, output_ranges, plain_tensors, range_in, range_of, subclass_kind)

_STRIDED = torch.strided
_Tensor = torch.Tensor
_OP, _ALLOC = E.OP, E.ALLOC
_get_ident = threading.get_ident


class TracingMode(TorchDispatchMode):
    """The tracer's dispatch mode; the work is in :func:`dispatch` and its variants (in C first, where built).

    PyTorch wraps a mode's ``__torch_dispatch__`` so that Dynamo never compiles it, at a cost of about a
    microsecond per op. streamsan skips that wrapper: once Dynamo is loaded, streamsan's files are put on Dynamo's
    skip list instead (:func:`dynamo_safe`), which costs nothing per op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer
        ALLOCATOR.modes.add(self)
        ctracer = ccore.configured() if not ALLOCATOR.unreported else None
        if ctracer is not None and type(self).__torch_dispatch__ is TracingMode.__torch_dispatch__:
            # PyTorch calls this instance attribute: the C tracer, which leaves what it does not handle to the
            # method below
            try:
                self.__torch_dispatch__ = ctracer.Dispatch(tracer, TracingMode.__torch_dispatch__.__get__(self), self)
            except (TypeError, AttributeError) as exc:  # a tracer it does not know: the Python tracer alone
                tracer.note_once("c-tracer", f"the C tracer is off ({exc}); the Python tracer runs alone")
            else:
                if tracer.stacks.native is None:  # StackTable.outside in C too
                    tracer.stacks.native = self.__torch_dispatch__.capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.tracer.tracing:
            if self.tracer.graphs.current is None:
                return func(*args, **(kwargs or {}))
            return self._guarded(dispatch_captured, func, types, args, kwargs or {})
        try:
            tracer = self.tracer
            plan = tracer.plans.get(id(func)) or tracer.plan(func)
            call = plan.decompose
            if call is not None:
                with self:  # (the mode is off inside its own handler: on again for the ops inside)
                    return call(*args, **(kwargs or {}))
            if plan.python_kernel is not None and not types:  # (a subclass's own dispatch handles its ops)
                kwargs = kwargs or {}
                dev = device_among(itertools.chain(args, kwargs.values()))
                key = plan.python_kernel[0 if dev >= 0 else 1]
                if key is not None:
                    return run_python_kernel(tracer, self, func, plan, key, dev, args, kwargs)
            if types:  # tensor subclasses (plain tensors give none)
                kind = subclass_kind(types)
                if kind == MEMORYLESS:
                    return func(*args, **(kwargs or {}))
                if kind == WRAPPER:
                    return dispatch_wrapped(self.tracer, func, args, kwargs or {})
            return dispatch(tracer, func, args, kwargs or {}, plan)
        except Exception as exc:
            ran = internal_error(self.tracer, exc, func)
            if ran is None:  # the op's own error: the program sees it as without streamsan
                raise
            return ran[1] if ran[0] else func(*args, **(kwargs or {}))

    def _guarded(self, handler, func, types, args, kwargs):
        """``handler(tracer, func, types, args, kwargs)`` under the same guard as the dispatch above (which spells it
        out: it is the hot path)."""
        try:
            return handler(self.tracer, func, types, args, kwargs)
        except Exception as exc:
            ran = internal_error(self.tracer, exc, func)
            if ran is None:
                raise
            return ran[1] if ran[0] else func(*args, **kwargs)


def dynamo_safe() -> None:
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
    raw = TracingMode.__dict__["__torch_dispatch__"]
    if not getattr(raw, "_streamsan_dynamo_safe", False):
        safe = torch._disable_dynamo(raw, recursive=True)
        safe._streamsan_dynamo_safe = True
        TracingMode.__torch_dispatch__ = safe


_dynamo_skipped = False


def internal_error(tracer, exc, func):
    """An exception escaped the dispatch: None if the op itself raised it, else (whether the op ran, its
    output) after the tracer's ``stop_on_bug`` (a bug of streamsan's must not break the program). Which it is: the
    innermost streamsan frame of the traceback stands on a line that calls the op, or not; an op that ran left its
    result in that frame's ``out``."""
    import linecache

    tb, own = exc.__traceback__, None
    while tb is not None:
        if is_own_file(tb.tb_frame.f_code.co_filename):
            own = tb
        tb = tb.tb_next
    line = linecache.getline(own.tb_frame.f_code.co_filename, own.tb_lineno) if own is not None else ""
    if own is None or "func(*args" in line or "call(*args" in line:
        return None
    tracer.stop_on_bug(exc, str(func))
    return "out" in own.tb_frame.f_locals, own.tb_frame.f_locals.get("out")


def dispatch(tracer, func, args, kwargs, plan=None):
    """An aten op on plain tensors, in Python (what the C core does for its common case, step for step)."""
    if plan is None:
        plan = tracer.plans.get(id(func)) or tracer.plan(func)
    if kwargs and kwargs.get("pin_memory"):
        return dispatch_pinning(tracer, func, plan, args, kwargs)
    if plan.skip:
        if not plan.fresh_outputs:
            if plan.record_stream:
                record_stream(tracer, args)
                tracer.record_stream_seen = _get_ident()
            return plan.call(*args, **kwargs)
        evs = tracer.buffer.events
        mark = len(evs)
        out = plan.call(*args, **kwargs)
        if tracer.buffer.events is not evs:  # another thread flushed while the op ran
            evs = tracer.buffer.events
            mark = 0
        if len(evs) > mark:  # an allocating op that touches no data (empty, empty_like, ...)
            fill_alloc_sizes(tracer, evs, mark, out)
        elif ALLOCATOR.unreported is not False:  # (the same, where the allocator does not report them)
            dev = device_of_output(out)
            if dev >= 0 and allocations_unreported(tracer):
                declare_outputs(tracer, evs, mark, out, dev, tracer.agent(dev, device.raw_stream(dev)),
                                tracer.stacks.outside(evs), tracer.ctx)
        return out
    if plan.pinning_or_copy:
        if plan.pinning or _maybe_pinned_output(plan, args, kwargs):
            return dispatch_pinning(tracer, func, plan, args, kwargs)
        learn_pinned(tracer, plan, args, kwargs)
    reads = []
    writes = []
    dev = -1
    cpu = cpu_r = None
    cpu_written = False
    rng = range_in
    attr, offset, raw_stream = device.ATTR, device.OFFSET, device.raw_stream  # (read once per op)
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
                if getattr(t, attr):
                    dev = t.get_device() + offset
                    r = rng(tracer, t, dev)
                elif t.is_cpu and tracer.pinned:
                    r = rng(tracer, t, E.PINNED)
                    if r is not None and is_write and tracer.staged.kept:
                        tracer.staged.forget((r,))
                else:
                    continue
                if r is not None:
                    (writes if is_write else reads).append(r)
            continue
        if not isinstance(v, _Tensor):
            continue
        if getattr(v, attr):
            d = v.get_device() + offset
            if dev < 0 or (plan.is_copy and not is_write):
                dev = d
            try:  # the common case, contiguous, inline; everything else in range_in
                n = v.nbytes
                r = (d, v.data_ptr(), n) if n and v.is_contiguous() else rng(tracer, v, d)
            except RuntimeError:
                r = rng(tracer, v, d)
        elif v.is_cpu:
            cpu = v
            cpu_written = is_write
            r = cpu_r = rng(tracer, v, E.PINNED) if tracer.pinned else None
        else:
            continue
        if r is not None:
            (writes if is_write else reads).append(r)
    if plan.indexed is not None and dev >= 0:
        index_rows(tracer, plan, args, kwargs, reads, writes)
    if dev < 0:
        if not plan.fresh_outputs:
            if not reads and not writes:
                return plan.call(*args, **kwargs)
            return dispatch_host(tracer, func, plan, args, kwargs, reads, writes)
        # a factory or a host-to-device copy naming its device, or a ``*_like`` / ``new_*`` factory of a CUDA
        # tensor (its argument not an access): known now, so the op has its own events while it runs
        dev = cuda_target(kwargs)
        if dev < 0:
            dev = device_among(args)
    evs = tracer.buffer.events
    ctx = tracer.ctx
    mine = None
    single = 0  # the data pointer of a single contiguous CUDA output
    flags = 0
    if plan.is_copy and cpu is not None:
        flags = _copy_flags(tracer, cpu, cpu_written, args, kwargs)
    if dev >= 0:
        a = tracer.agent_of.get((dev, raw_stream(dev))) or tracer.agent(dev, raw_stream(dev))
        stack = tracer.stacks.outside(evs)
        me = _get_ident()
        mine = tracer.op_agent = tracer.buffer.ops_of_threads[me] = (dev, a, stack, ctx, me, OpEvents())
        if cpu_r is not None and not cpu_written and not flags:  # an asynchronous copy out of pinned memory
            staged_write(tracer, evs, cpu, cpu_r, stack, ctx)
    mark = len(evs)
    try:
        out = plan.call(*args, **kwargs)
    finally:
        if mine is not None:
            tracer.buffer.ops_of_threads.pop(mine[4], None)
            if tracer.op_agent is mine:
                tracer.op_agent = None
    if mine is not None:  # the events this thread fired inside the op, whatever other threads did meanwhile
        evs = mine[5]
        mark = 0
    elif tracer.buffer.events is not evs:  # another thread flushed while the op ran: all since then is inside it
        evs = tracer.buffer.events
        mark = 0
    if plan.fresh_outputs:
        if dev < 0:
            dev = device_of_output(out)
            if dev < 0:  # a CPU op with CPU outputs
                if not reads and not writes:
                    return out
                evs.append(host_access(tracer.staged, plan.name, reads, writes, tracer.stacks.capture(evs, 2), ctx))
                return out
            a = tracer.agent(dev, raw_stream(dev))  # e.g. an H2D copy or a factory with device=cuda
            stack = tracer.stacks.outside(evs)
        if out.__class__ is _Tensor and getattr(out, attr):  # the common case, one plain tensor, inline
            try:
                n = out.nbytes
                if n and out.is_contiguous():
                    single = out.data_ptr()
                    writes.append((out.get_device() + offset, single, n))
                else:
                    output_ranges(tracer, out, writes)
            except RuntimeError:
                output_ranges(tracer, out, writes)
        else:
            output_ranges(tracer, out, writes)
        if ALLOCATOR.unreported is not False and allocations_unreported(tracer):
            declare_outputs(tracer, evs, mark, out, dev, a, stack, ctx)
    tracer.saw_cuda = True
    if cpu_written and tracer.staged.kept:
        tracer.staged.forget(writes)
    known = tracer.index_values
    if known.spans:
        values_after(tracer, plan, args, kwargs, out, () if plan.is_copy and cpu is not None else reads, writes)
    if cpu is not None and plan.is_copy and not cpu_written:  # a copy from the host: index values seen
        dst = out if plan.fresh_outputs else args[0] if args else kwargs.get("self")
        if isinstance(dst, _Tensor) and getattr(dst, attr):
            known.learn_copy(dst, cpu)
    elif plan.arange and getattr(out, attr):
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
        place(tracer, evs, mark, op, out if plan.fresh_outputs else None, collective=plan.collective)
    if tracer.engine_threads and _get_ident() in tracer.engine_threads:
        engine_op(tracer, evs, plan, args, kwargs, out, a, stack)
    if mine is not None:
        buf = tracer.buffer.events
        buf.extend(evs)
        evs = buf
    if len(evs) >= tracer.buffer.batch:
        tracer.buffer.flush()
    return out


def values_after(tracer, plan, args, kwargs, out, reads, writes) -> None:
    """An op that may read or write known index values ran (both tracers): what an op of
    :data:`streamsan.tracers.indices.DERIVED` made from them is known too; what any op overwrote is not."""
    known = tracer.index_values
    spans = known.spans
    result = None
    if plan.derives and any(s[0] == r[0] and s[1] < r[1] + r[2] and r[1] < s[2]
                            for r in itertools.chain(reads, writes) for s in spans):
        result = known.derive(plan, args, kwargs or {})
    known.written(writes)
    if (result is not None and isinstance(out, _Tensor) and getattr(out, device.ATTR) and out.dtype in INDEX_DTYPES
            and isinstance(result, _Tensor) and result.numel() == out.numel() and out.is_contiguous()):
        known.learn(out, flat_values(result))


def index_rows(tracer, plan, args, kwargs, reads, writes) -> None:
    """An index-addressed op whose indices' values are known touches only the rows they name: its indexed
    tensor's whole range (in ``reads`` or ``writes``) becomes those rows' ranges."""
    found = indexed_rows(plan.indexed, args, kwargs, tracer.index_values)
    if found is None:
        return
    t, rows = found
    whole = range_in(tracer, t, t.get_device() + device.OFFSET)
    for ranges in (writes, reads):
        for i, r in enumerate(ranges):
            if r == whole:
                ranges[i:i + 1] = rows
                return


def _copy_flags(tracer, cpu, cpu_written, args, kwargs) -> int:
    """OP_BLOCKING for copies the host waits for: into pageable memory (CUDA returns once it is done, even
    when non_blocking), and blocking copies (their stream synchronization is also reported by PyTorch)."""
    p = cpu.data_ptr() if cpu.layout is _STRIDED else 0
    if not p:
        return 0
    pinned = is_pinned(tracer, cpu, p)
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
    if not non_blocking or (cpu_written and not pinned):
        return E.OP_BLOCKING
    return 0


def dispatch_wrapped(tracer, func, args, kwargs):
    """An op on wrapper subclasses (DTensor, ...): the subclass runs it on its inner tensors where the dispatch
    mode does not look, so the op's accesses are the inner tensors', on the current stream of their device."""
    plan = tracer.plans.get(id(func)) or tracer.plan(func)
    reads, writes = [], []
    dev = -1
    for pos, name, is_write, _is_list in plan.tensor_args:
        v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
        for t in plain_tensors(v):
            if getattr(t, device.ATTR) and dev < 0:
                dev = t.get_device() + device.OFFSET
            r = None if plan.skip else range_of(tracer, t)
            if r is not None:
                (writes if is_write else reads).append(r)
    if dev < 0:
        dev = cuda_target(kwargs)
    stack = tracer.stacks.capture(tracer.buffer.events, 2)
    out, a, evs, mark = run_inside(tracer, func, args, kwargs, dev, stack)
    plain = list(plain_tensors(out))
    if plan.skip:
        fill_alloc_sizes(tracer, evs, mark, plain)
        commit(tracer, evs)
        return out
    if plan.fresh_outputs:
        output_ranges(tracer, plain, writes)
    if a == E.HOST:  # no CUDA tensor among the arguments it reads (zeros_like reads none): its outputs'
        dev = next((t.get_device() + device.OFFSET for t in plain if getattr(t, device.ATTR)), -1)
        if dev < 0:
            if reads or writes:  # pinned host memory only
                evs.append(host_access(tracer.staged, plan.name, reads, writes, stack, tracer.ctx))
            commit(tracer, evs)
            return out
        a = tracer.agent(dev, device.raw_stream(dev))
    tracer.saw_cuda = True
    tracer.index_values.written(writes)
    place(tracer, evs, mark, (E.OP, a, plan.name, tuple(reads), tuple(writes), stack, tracer.ctx, 0),
          plain if plan.fresh_outputs else None, collective=plan.collective)
    commit(tracer, evs)
    return out


def dispatch_host(tracer, func, plan, args, kwargs, reads, writes):
    """An op on CPU tensors that touches pinned memory: a host access."""
    stack = tracer.stacks.capture(tracer.buffer.events, 3)
    out = func(*args, **kwargs)
    if plan.fresh_outputs:
        output_ranges(tracer, out, writes)
    evs = tracer.buffer.events
    evs.append(host_access(tracer.staged, plan.name, reads, writes, stack, tracer.ctx))
    if len(evs) >= tracer.buffer.batch:  # (ops of other threads still running see the new list)
        tracer.buffer.flush()
    return out


def dispatch_pinning(tracer, func, plan, args, kwargs):
    """Ops whose output may be new pinned memory: pin_memory(), and non-blocking device-to-host copies.
    The pinned block is declared (ALLOC) before the op that fills it."""
    dev = -1
    for pos, name, _w, is_list in plan.tensor_args:
        v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
        if isinstance(v, torch.Tensor) and getattr(v, device.ATTR):
            dev = v.get_device() + device.OFFSET
    stack = tracer.stacks.outside(tracer.buffer.events)
    if dev >= 0:
        tracer.saw_cuda = True
    out, a, evs, mark = run_inside(tracer, func, args, kwargs, dev, stack)
    pre = []
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor) and t.is_cpu and t.layout is _STRIDED and t.nbytes and \
                known_pinned_block(tracer, t):
            ev = register_pinned(tracer, t, stack)
            if ev is not None:
                pre.append(ev)
    if plan.skip:  # empty(..., pin_memory=True): a new block, no access
        evs.extend(pre)
        commit(tracer, evs)
        return out
    reads, writes = args_ranges(tracer, plan, args, kwargs)
    output_ranges(tracer, out, writes)
    op = (E.OP, a, plan.name, tuple(reads), tuple(writes), stack, tracer.ctx, 0)
    place(tracer, evs, mark, op, out, pre)
    commit(tracer, evs)
    return out


def run_python_kernel(tracer, mode, func, plan, key, dev, args, kwargs):
    """Run an op's Python implementation (its kernel at dispatch ``key``; ``dev``: the CUDA device of its
    tensors, or -1) with the mode on (``mode``: the one whose handler this is), so its ops are traced on the
    streams they run on. Its own work may be invisible (a pybind extension launching kernels, as flash-attn's
    custom ops wrap theirs): unless traced ops inside wrote every tensor the op writes by its schema (a result,
    an ``(a!)`` argument), or, for an op that writes none, traced ops ran inside at all, the op is also one
    access by its schema, on the stream current when it was called."""
    agent = tracer.agent(dev, device.raw_stream(dev)) if dev >= 0 else E.HOST
    call = functools.partial(func._op_dk, key)  # (no frame of its own: an error inside is the program's)
    buf = tracer.buffer
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
    if not tracer.tracing:
        return out
    reads, writes = args_ranges(tracer, plan, args, kwargs)
    output_ranges(tracer, out, writes)
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
        tracer.emit((E.OP, agent, plan.name, tuple(reads), tuple(writes),
                     tracer.stacks.outside(tracer.buffer.events), tracer.ctx, 0))
    return out


def record_stream(tracer, args) -> None:
    """``record_stream(t, stream)``: the block of ``t`` is used by that stream too."""
    t, s = args[0], args[1]
    if not isinstance(t, torch.Tensor) or not getattr(t, device.ATTR) or t.layout is not _STRIDED:
        return
    dev, handle = device.stream_key(s)
    a = tracer.agent(dev, handle)
    base = t.untyped_storage().data_ptr()
    tracer.emit((E.RECORD_STREAM, t.get_device() + device.OFFSET, base, a,
                 tracer.stacks.outside(tracer.buffer.events)))


def _covers(w, r) -> bool:
    """Whether range w holds all of range r's bytes (same space)."""
    return w[0] == r[0] and w[1] <= r[1] and r[1] + r[2] <= w[1] + w[2]


def _maybe_pinned_output(plan, args, kwargs) -> bool:
    """A non-blocking copy from CUDA to the CPU returns pinned memory (``_to_copy`` only)."""
    if plan.name != "aten::_to_copy" or not kwargs.get("non_blocking"):
        return False
    src = args[0] if args else kwargs.get("self")
    dev = kwargs.get("device")
    if not isinstance(src, torch.Tensor) or not getattr(src, device.ATTR) or dev is None:
        return False
    return (dev.type if isinstance(dev, torch.device) else torch.device(dev).type) == "cpu"
