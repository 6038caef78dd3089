"""What the native observer's differential tests share (CPU and GPU): a recording dispatch mode, a run of a program
under it and the observer at once, and the comparison of the two op sequences.

The recording mode is pushed first and the observer started above it, so the observer models a mode on top of the
recorder, which sees exactly the calls that mode would pass on: the same ops. Each op the recorder sees notes the
observer's next sequence number, so it falls inside the span (seq, end] of the record that holds it.
"""

from __future__ import annotations

import sys
import threading
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from streamsan.native import observer, records

FRAMES = observer.DEFAULT_FRAMES
DEVICE_TYPES = {"cpu": 0, "cuda": 1}  # c10::DeviceType
# Ops RecordFunction never reports (c10::ObservedOperators): none touches tensor data.
UNOBSERVED = {"aten::size", "aten::is_leaf", "aten::output_nr", "aten::_version", "aten::is_complex",
              "profiler::_record_function_enter", "profiler::_record_function_enter_new",
              "profiler::_record_function_exit"}


class ModeOp(NamedTuple):
    seq: int  # the observer's next sequence number when the mode saw the op
    thread: int
    name: str
    overload: str
    inputs: tuple
    outputs: tuple
    site: tuple
    stream: tuple | None


def _python_key(t) -> bool:
    return torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


def tensor_meta(t) -> tuple:
    """What the comparison holds of a tensor the mode sees: dtype, device, and for plain strided tensors their
    storage, byte offset, sizes and strides (a subclass's layout is its own business: the observer reads none)."""
    dtype = str(t.dtype).replace("torch.", "")
    dev = (DEVICE_TYPES.get(t.device.type, t.device.type), -1 if t.device.index is None else t.device.index)
    if _python_key(t):
        return ("subclass", dtype) + dev
    try:
        st = t.untyped_storage()
        storage = (st.data_ptr(), st.nbytes())
    except (RuntimeError, NotImplementedError):
        storage = (0, 0)
    return (dtype,) + dev + storage + (t.storage_offset() * t.element_size(), tuple(t.shape), tuple(t.stride()),
                                       t.element_size())


def record_meta(t: records.Tensor) -> tuple:
    dev = (t.device_type, t.device_index)
    if t.flags & records.PYTHON_KEY:
        return ("subclass", t.dtype) + dev
    return (t.dtype,) + dev + (t.data, t.storage_nbytes, t.offset, tuple(t.sizes), tuple(t.strides), t.itemsize)


def _tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(tensor_meta(obj))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    return out


def _site(frame) -> tuple:
    site = []
    while frame is not None and len(site) < FRAMES:
        site.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return tuple(site)


def _current_stream(inputs):
    for t in inputs:
        if t[0] != "subclass" and t[1] == DEVICE_TYPES["cuda"]:
            s = torch.cuda.current_stream(t[2])
            return (1, t[2], s.stream_id)
    return None


class Recorder(TorchDispatchMode):
    """A dispatch mode that notes each op it is handed, then runs it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (no wrapper frame between the caller and __torch_dispatch__)

    def __init__(self, sequence):
        super().__init__()
        self.sequence = sequence
        self.ops: list[ModeOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seq = self.sequence()
        site = _site(sys._getframe().f_back)  # (None on an engine thread: no Python frame outside)
        inputs = tuple(_tensors(list(args) + list(kwargs.values()), []))
        stream = _current_stream(inputs)
        out = func(*args, **kwargs)
        schema = func._schema
        if schema.name not in UNOBSERVED:
            outputs = tuple(_tensors(out, []))
            if stream is None:
                stream = _current_stream(outputs)
            self.ops.append(ModeOp(seq, threading.get_ident(), schema.name, schema.overload_name, inputs, outputs,
                                   site, stream))
        return out


class Run(NamedTuple):
    records: list
    events: list
    ops: list  # the recorder's


def observe(fn, *args, frames: int = FRAMES, recorder_above: bool = False) -> Run:
    """Run fn(*args) under the recorder and the observer (started above it; below it with ``recorder_above``);
    what each saw."""
    module, reason = observer.load()
    assert module is not None, reason
    dec = observer.decoder()
    observer.drain()  # (what an earlier run left)
    rec = Recorder(module.sequence)
    if recorder_above:
        observer.start(frames)
    rec.__enter__()
    try:
        if not recorder_above:
            observer.start(frames)
        try:
            fn(*args)
        finally:
            observer.stop()
    finally:
        rec.__exit__(None, None, None)
    got, events = dec.decode(observer.drain())
    return Run(got, events, rec.ops)


def arm_new_threads(rec: Recorder):
    """A threading.setprofile hook that pushes the recorder in each new thread, then arms the observer there (as
    the torch tracer pushes its mode in each new thread)."""
    def hook(frame, event, arg):
        sys.setprofile(None)
        rec.__enter__()
        observer.arm_thread()
    return hook


def record_key(r) -> tuple:
    return (r.name, r.overload, r.thread, tuple(record_meta(t) for t in r.inputs),
            tuple(record_meta(t) for t in r.outputs))


def op_key(m: ModeOp) -> tuple:
    return (m.name, m.overload, m.thread, m.inputs, m.outputs)


def _ids(site) -> tuple:
    return tuple((id(c), lasti) for c, lasti in site)


_HANDLER = Recorder.__torch_dispatch__.__code__


def _torch_frame(code_id: int, codes: dict) -> bool:
    code = codes.get(code_id)
    return code is not None and f"{__import__('os').sep}torch{__import__('os').sep}" in code.co_filename


def site_matches(obs: tuple, mode: tuple, codes: dict) -> bool:
    """Whether the observer's call site is the mode's: the same frames, or the mode's with torch's own Python
    frames first (a Python kernel the dispatcher ran before handing the op to the mode: the autograd kernel of a
    ``torch.library.custom_op``, the Python dispatcher), which the observer, at the op's entry, cannot see."""
    if obs == mode:
        return True
    if not obs:
        return False
    for j in range(1, len(mode)):
        if mode[j] == obs[0] and obs[:len(mode) - j] == mode[j:]:
            return all(_torch_frame(c, codes) for c, _ in mode[:j])
    return False


class Comparison(NamedTuple):
    exact: int  # records equal to the mode's op, where the observer claims the mode's view
    covered: int  # mode ops inside a record marked as not the mode's view
    children_equal: bool  # whether those marked records' children are exactly the covered ops
    marked: tuple  # (name, flags) of each marked record
    interpreter_detaches: int  # the mode's detaches that are no dispatcher call (see compare)
    sites_below_python: int  # exact matches whose mode site had torch's Python frames first
    problems: list


def compare(run: Run, check_streams: bool = False, sites: bool = True, seqs: bool = True) -> Comparison:
    """The observer's records against the recorder's ops, thread by thread, in order.

    With a mode on the stack, TensorImpl::shallow_copy_and_detach (autograd saving an op's output, ``.data``)
    hands the mode an ``aten::detach`` through the PyInterpreter, with no dispatcher call: RecordFunction never
    sees it, and without a mode there is no such op. Such detaches of the mode's are counted apart (the torch
    tracer takes ``detach`` for no access), and so are the dispatcher calls the recorder's own handler makes for
    them (the observer sees those, where no op of its own is open). ``sites=False`` leaves call sites out,
    ``seqs=False`` the check that each mode op falls in its record's span."""
    codes = {}
    for site in [r.site for r in run.records] + [m.site for m in run.ops]:
        for c, _ in site:
            codes[id(c)] = c
    counts = {"exact": 0, "covered": 0, "detaches": 0, "below": 0}
    problems = []
    children_equal = True
    marked = []

    def align(recs, ops, where, exact=True):
        """Match records to mode ops one for one, in order; False on the first difference."""
        i = 0
        ok = True
        for r in recs:
            while i < len(ops) and ops[i].name == "aten::detach" and op_key(ops[i]) != record_key(r):
                counts["detaches"] += 1
                i += 1
            if i >= len(ops):
                if exact:
                    problems.append(f"{where}: the observer has {r.name}.{r.overload} (seq {r.seq}), the mode has "
                                    f"nothing more")
                return False
            m = ops[i]
            i += 1
            if record_key(r) != op_key(m):
                if exact:
                    problems.append(f"{where}: seq {r.seq}: observer {record_key(r)} != mode {op_key(m)}")
                ok = False
            elif sites and not site_matches(_ids(r.site), _ids(m.site), codes):
                if exact:
                    problems.append(f"{where}: {r.name} (seq {r.seq}): call site {_show_site(r.site)} != the "
                                    f"mode's {_show_site(m.site)}")
                ok = False
            elif seqs and not r.seq < m.seq <= r.end:
                if exact:
                    problems.append(f"{where}: {r.name} at seq {r.seq}..{r.end}, the mode's at {m.seq}")
                ok = False
            elif check_streams and r.stream != m.stream:
                if exact:
                    problems.append(f"{where}: {r.name}: stream {r.stream} != the mode's {m.stream}")
                ok = False
            elif exact:
                counts["exact"] += 1
                counts["below"] += _ids(r.site) != _ids(m.site)
        for m in ops[i:]:
            if m.name == "aten::detach":
                counts["detaches"] += 1
                continue
            if exact:
                problems.append(f"{where}: the mode has {m.name}.{m.overload} (seq {m.seq}), the observer has "
                                f"nothing more")
            ok = False
        return ok

    threads = sorted({r.thread for r in run.records} | {m.thread for m in run.ops})
    for thread in threads:
        recs = [r for r in run.records
                if r.thread == thread and not (r.parent == 0 and any(c is _HANDLER for c, _ in r.site))]
        ops = [m for m in run.ops if m.thread == thread]
        kids: dict[int, list] = {}
        for r in recs:
            kids.setdefault(r.parent, []).append(r)

        def flat(r):
            if not r.flags & records.NOT_THE_MODES_VIEW:
                return [r]
            return [x for c in kids.get(r.seq, []) for x in flat(c)]

        # the top-level records: each the mode's view (matched one for one) or marked (covering the ops inside)
        tops = kids.get(0, [])
        covering = [r for r in tops if r.flags & records.NOT_THE_MODES_VIEW]
        mode_plain = [m for m in ops if not any(r.seq < m.seq <= r.end for r in covering)]
        for r in covering:
            marked.append((f"{r.name}.{r.overload}", r.flags))
            inside = [m for m in ops if r.seq < m.seq <= r.end]
            counts["covered"] += len(inside)
            saved = dict(counts)
            if not align(flat(r), inside, f"thread {thread} inside {r.name}", exact=False):
                children_equal = False
            counts.update({k: saved[k] for k in ("exact", "below", "detaches")})
        align([r for r in tops if r not in covering], mode_plain, f"thread {thread}")
    return Comparison(counts["exact"], counts["covered"], children_equal, tuple(marked), counts["detaches"],
                      counts["below"], problems)


def _show_site(site) -> str:
    return " < ".join(f"{c.co_name}@{c.co_filename.split('/')[-1]}:{lasti}" for c, lasti in site[:4])
