"""The confirm runtime inside one run of the program: finds the ops at the planned call sites, delays one site's
ops on their stream, checksums the observed sites' outputs, and writes what it observed at exit.

It starts only in a process whose environment names a run spec (``STREAMSAN_CONFIRM``, a JSON file that
:mod:`.orchestrate` writes: the observed sites, the delayed site or none, the delay, how many occurrences to
delay, where to write). Torch ops are seen by a dispatch mode entered on every thread once torch is imported;
CuPy calls through the CuPy tracer's traced surfaces, with the tracer's analysis replaced by this runtime's. A
call site is found as the tracer finds it: the innermost frame of user code (streamsan's own frames skipped).
Nothing runs inside a CUDA graph capture (a delay or a checksum there would be captured into the graph).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading

from ..analysis.locations import is_library_frame, short_path
from ..imports import when_imported
from ..stacks import is_own_file, is_torch_api_wrapper
from .inject import CupyDelay, TorchDelay
from .observe import Observations, cupy_checksum, torch_checksum

ENV = "STREAMSAN_CONFIRM"
OBSERVED_FILE = "observed-{pid}.json"

_runtime = None


class _FileKinds(dict):
    """filename -> 0 (streamsan's own), 1 (library), 2 (user code), computed once per file."""

    def __missing__(self, filename):
        kind = 0 if is_own_file(filename) else 1 if is_library_frame(filename) else 2
        self[filename] = kind
        return kind


_kinds = _FileKinds()


def call_site(frame) -> str:
    """``path:line`` of the innermost user frame from ``frame`` outwards (else the innermost frame not
    streamsan's), as findings spell their locations."""
    first = None
    while frame is not None:
        kind = _kinds[frame.f_code.co_filename]
        if kind == 2 and is_torch_api_wrapper(frame.f_code):  # (as the stacks of findings leave it out)
            kind = 1
        if kind == 2:
            return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        if kind == 1 and first is None:
            first = (frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return f"{short_path(first[0])}:{first[1]}" if first else ""


class Runtime:
    """One run's hooks. ``spec``: the run spec (see the module docstring)."""

    def __init__(self, spec: dict):
        self.sites = [(s["location"], s["op"]) for s in spec["sites"]]
        self.ops = {op for _, op in self.sites}
        self.any_op = None in self.ops
        self.delay_site = spec.get("delay_site")  # an index into sites, or None
        self.limit = spec.get("occurrences")  # the first N occurrences are delayed; None: all
        self.out_dir = spec["out_dir"]
        self.names: dict[str, int] = {}  # streamsan.observe() names -> their site index (after the sites)
        self.obs = Observations(len(self.sites))
        self.delayed = 0
        self.torch_delay = TorchDelay(spec["delay_ms"])
        self.cupy_delay = CupyDelay(spec["delay_ms"])
        self._local = threading.local()
        self._lock = threading.Lock()
        self._finished = False
        self.torch = None
        self.cupy = None
        self.mode = None  # the dispatch mode entered on the thread that imported torch
        self._op_names: dict = {}

    # ------------------------------------------------------------------ matching
    def _matches(self, op: str, frame) -> list:
        if op not in self.ops and not self.any_op:
            return []
        loc = call_site(frame)
        return [i for i, (l, o) in enumerate(self.sites) if l == loc and (o is None or o == op)]

    def _arrive(self, hits: list) -> tuple:
        """Count the op at each of its sites; whether to delay it and which (site, occurrence) to checksum."""
        with self._lock:
            delay = False
            wanted = []
            for i in hits:
                occ = self.obs.arrive(i)
                if i == self.delay_site and (self.limit is None or occ <= self.limit):
                    delay = True
                    self.delayed += 1
                if self.obs.wants_value(i):
                    wanted.append((i, occ))
            return delay, wanted

    # ------------------------------------------------------------------ torch
    def start_torch(self, torch) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        runtime = self
        self.torch = torch

        class ConfirmMode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return runtime.torch_op(func, args, kwargs or {})

        self._mode_class = ConfirmMode
        self.mode = ConfirmMode()
        self.mode.__enter__()
        threading.setprofile(self._thread_start)
        self._at_exit()

    def _thread_start(self, frame, event, arg):
        sys.setprofile(None)
        self._mode_class().__enter__()

    def _torch_name(self, func) -> str:
        """The op's name as the torch tracer writes it (``aten::add.Tensor``), made once per overload."""
        name = self._op_names.get(func)
        if name is None:
            schema = func._schema
            name = self._op_names[func] = schema.name + ("." + schema.overload_name if schema.overload_name else "")
        return name

    def torch_op(self, func, args, kwargs):
        torch = self.torch
        hits = self._matches(self._torch_name(func), sys._getframe(1))
        if not hits or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
            return func(*args, **kwargs)
        delay, wanted = self._arrive(hits)
        if delay:
            self.torch_delay()
        out = func(*args, **kwargs)
        if wanted:
            value = torch_checksum(torch, self._torch_outputs(func, args, kwargs, out))
            for site, occ in wanted:
                self.obs.keep(site, occ, "torch", value)
        return out

    def _torch_outputs(self, func, args, kwargs, out) -> list:
        from torch.utils._pytree import tree_leaves

        tensors = [t for t in tree_leaves(out) if isinstance(t, self.torch.Tensor)]
        if tensors:
            return tensors
        written = []  # (an op that returns nothing, such as a _foreach_ op: the arguments it writes)
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
                written += [t for t in tree_leaves(value) if isinstance(t, self.torch.Tensor)]
        return written

    # ------------------------------------------------------------------ CuPy
    def start_cupy(self, cupy) -> None:
        from ..sink import EventBuffer
        from ..tracers.cupy.tracer import CupyTracer

        self.cupy = cupy
        tracer = CupyTracer(EventBuffer())  # (its traced surfaces; its events are dropped)
        tracer.start(cupy)
        runtime = self

        def op(name, fn, args, kwargs, analyze, stream_of=None):
            return runtime.cupy_op(tracer, name, fn, args, kwargs, stream_of)

        tracer._op = op
        self._at_exit()

    def cupy_op(self, tracer, name, fn, args, kwargs, stream_of):
        local = self._local
        if getattr(local, "depth", 0):
            return fn(*args, **kwargs)
        if len(tracer.buffer.events) > 4096:
            tracer.buffer.flush()  # (no consumers: the events of the tracer's other patches are dropped)
        hits = self._matches(name, sys._getframe(2))
        if not hits:
            return fn(*args, **kwargs)
        local.depth = 1
        try:
            stream = self._cupy_stream(stream_of(args, kwargs) if stream_of is not None else None)
            if _capturing(stream):
                return fn(*args, **kwargs)
            delay, wanted = self._arrive(hits)
            if delay:
                self.cupy_delay(stream)
            out = fn(*args, **kwargs)
            if wanted:
                arrays = self._cupy_arrays(out) or self._cupy_arrays(kwargs.get("out")) or self._cupy_arrays(args[:1])
                with stream if stream is not None else contextlib.nullcontext():
                    value = cupy_checksum(self.cupy, arrays)
                for site, occ in wanted:
                    self.obs.keep(site, occ, "cupy", value)
            return out
        finally:
            local.depth = 0

    def _cupy_stream(self, stream):
        cupy = self.cupy
        if stream is None:
            return cupy.cuda.get_current_stream()
        if isinstance(stream, int):
            return cupy.cuda.ExternalStream(stream)
        return stream

    def _cupy_arrays(self, value) -> list:
        if isinstance(value, self.cupy.ndarray):
            return [value]
        if isinstance(value, (tuple, list)):
            return [a for a in value if isinstance(a, self.cupy.ndarray)]
        return []

    # ------------------------------------------------------------------ named values
    def observe(self, value, name: str) -> None:
        """A value the program names (``streamsan.observe``): checksummed on the current stream."""
        with self._lock:
            site = self.names.get(name)
            if site is None:
                site = self.names[name] = len(self.obs.counts)
                self.obs.counts.append(0)
            occ = self.obs.arrive(site)
            if not self.obs.wants_value(site):
                return
        cupy = self.cupy or sys.modules.get("cupy")
        if cupy is not None and isinstance(value, cupy.ndarray):
            self.obs.keep(site, occ, "cupy", cupy_checksum(cupy, [value]))
            return
        torch = self.torch or sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            self.obs.keep(site, occ, "torch", torch_checksum(torch, [value]))

    # ------------------------------------------------------------------ exit
    def _at_exit(self) -> None:
        """(Again at each library's import: handlers run last registered first, so this one runs before the
        libraries' own.)"""
        atexit.unregister(self.finish)
        atexit.register(self.finish)

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        rows = []
        try:
            if self.torch is not None and self.torch.cuda.is_initialized():
                self.torch.cuda.synchronize()
            if self.cupy is not None:
                self.cupy.cuda.Device().synchronize()
            rows = self.obs.read()
            error = None
        except Exception as e:  # (a CUDA error: what was read is kept, and the run says it failed)
            error = f"{type(e).__name__}: {e}"
        names = sorted(self.names, key=self.names.get)
        result = {"pid": os.getpid(), "argv": list(sys.argv),
                  "sites": [f"{o or '*'} @ {l}" for l, o in self.sites] + [f"observe({n})" for n in names],
                  "sequence": self.obs.sequence, "truncated": self.obs.truncated, "values": rows,
                  "delayed": self.delayed, "error": error}
        path = os.path.join(self.out_dir, OBSERVED_FILE.format(pid=os.getpid()))
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)


def _capturing(stream) -> bool:
    try:
        return bool(stream.is_capturing())
    except Exception:  # (a CuPy without the query, or a stream it cannot query)
        return False


def observe(value, name: str) -> None:
    """``streamsan.observe``: no-op outside a confirm run."""
    if _runtime is not None:
        _runtime.observe(value, name)


def start_from_env() -> None:
    """Start the runtime if this process runs under ``streamsan confirm`` (the spec named by ``STREAMSAN_CONFIRM``)."""
    global _runtime
    path = os.environ.get(ENV)
    if not path or _runtime is not None:
        return
    with open(path) as f:
        spec = json.load(f)
    _runtime = Runtime(spec)
    when_imported("torch", _runtime.start_torch)
    when_imported("cupy", _runtime.start_cupy)
    atexit.register(_runtime.finish)
