"""Sessions: wire tracers to an analyzer and/or a trace file.

* ``with streamsan.watch() as s: ...`` analyzes in this process; ``s.findings``, ``s.report()``,
  ``s.save(path)`` and ``s._repr_html_()`` (notebooks) give the result.
* ``streamsan.enable()`` / ``streamsan.disable()``: the same without a ``with`` block.
* A session started while another is active (``watch()`` in ``watch()``, ``enable()`` twice, a program's
  ``watch()`` under ``streamsan wrap`` or ``pytest --streamsan``) joins it, with one note: its findings are the
  active session's over its own span (under ``wrap``, whose processes only record, they are in wrap's report).
* :func:`start_from_env` is what ``streamsan wrap`` runs in every Python process it starts (through its
  ``sitecustomize``): it records a trace file in ``$STREAMSAN_SESSION_DIR`` that the wrapping process
  analyzes, so a crash of the program loses at most the last unflushed batch of events.

Tracers attach when their library is imported (never importing it themselves).
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import signal
import sys
import threading

from . import events as E
from .analysis.analyzer import ANALYZER_ERROR, Analyzer, feed_guarded
from .imports import when_imported
from .agents import StreamRegistry
from .sink import EventBuffer
from .stacks import StackTable
from .tracers.addresses import LiveMemory
from .tracers.protocol import Tracer

log = logging.getLogger("streamsan")

SCOPES = ("full", "hooks")
# Problems that mean some events were not analyzed.
INCOMPLETE_PREFIXES = (ANALYZER_ERROR, "the analysis helper stopped")


class Session:
    """One tracing session. ``analyze``: run the analyzer; ``helper``: run it in a helper process
    (:mod:`streamsan.helper`) rather than in this one; ``trace_path``: also record (``compress_trace``: with
    compressed frames)."""

    def __init__(self, scope: str = "full", trace_path: str | None = None, analyze: bool = True,
                 header: dict | None = None, echo: bool = True, helper: bool = False, compress_trace: bool = True):
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {scope!r}")
        self.scope = scope
        self._analyzer = Analyzer() if analyze and not helper else None
        self._helper = None
        self._use_helper = analyze and helper
        self.writer = None
        self._trace_path = trace_path
        consumers = []
        if trace_path:
            from .trace import TraceWriter

            self.writer = TraceWriter(trace_path, header, compress=compress_trace)
            consumers.append(self.writer.write)
        if analyze:
            consumers.append(self._feed)
        self.buffer = EventBuffer(consumers)
        self.streams = StreamRegistry(self.buffer)
        self.memory = LiveMemory()  # the allocations every tracer knows, by address (integer kernel arguments)
        self.stacks = StackTable()
        self.tracers: dict[str, Tracer] = {}
        self.active = False
        self.problems: list[str] = []
        self.echo = echo  # say notes on stderr (not under `streamsan wrap`, whose report says them)
        self._torch_unsupported = False
        self.analyzes = analyze
        self._outer: Session | None = None  # the active session this one joined
        self._counts_before: dict = {}  # joined: each finding's count when this session started
        self._region: list | None = None  # joined and stopped: its findings

    @property
    def analyzer(self):
        """The analyzer: in a helper session, a copy of the helper's as of now (while active) or its final one;
        in a joined session, the active session's, seen with this session's findings."""
        if self._outer is not None:
            outer = self._outer.analyzer if self._outer.analyzes else None
            return _Region(outer or Analyzer(), self.findings)
        if self._helper is not None:
            self.buffer.flush()
            a, problems = self._helper.snapshot()
            self._add_problems(problems, self._helper.problem)
            return a if a is not None else Analyzer()
        return self._analyzer

    def _add_problems(self, problems, helper_problem) -> None:
        for p in list(problems) + ([helper_problem] if helper_problem else []):
            if p not in self.problems:
                self.problems.append(p)
                log.warning("streamsan: %s", p)

    def _feed(self, batch) -> None:
        if self._helper is not None:
            self._helper.feed(batch)
            return
        if self._analyzer is not None:
            msg = feed_guarded(self._analyzer, batch, self.problems)
            if msg:
                log.warning("streamsan: %s", msg)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Session":
        global _current
        if _current is not None and _current is not self and _current.active:
            return self._join(_current)
        _current = self
        self.active = True
        if self.echo:
            from .config import environment_warnings

            for line in environment_warnings():
                if line not in _said:
                    _said.add(line)
                    print(line, file=sys.stderr)
        if self._use_helper and self._helper is None and self._analyzer is None:
            from .helper import AnalysisHelper

            helper = AnalysisHelper()
            if helper.alive:
                self._helper = helper
            else:  # analyze here instead
                log.info("streamsan: %s; analyzing in this process", helper.problem)
                self._analyzer = Analyzer()
        when_imported("torch", self._attach_torch)
        when_imported("cupy", self._attach_cupy)
        when_imported("transformers", self._attach_hooks)
        return self

    def _attach_torch(self, torch_module) -> None:
        if not self.active or "torch" in self.tracers:
            return
        from .tracers.support import check_torch

        problem = check_torch(torch_module)
        if problem:
            self._torch_unsupported = True
            self._note(problem)
            return
        from .tracers.torch.tracer import TorchTracer

        tracer = TorchTracer(self.buffer, self.streams, self.stacks, scope=self.scope)
        tracer.on_note = self._note
        self.tracers["torch"] = tracer
        self.memory.add_pinned(tracer.pinned)
        tracer.start()
        when_imported("triton", lambda module: tracer.patch_triton(module, self.memory))

    def _attach_cupy(self, cupy_module) -> None:
        if not self.active or "cupy" in self.tracers:
            return
        from .tracers.support import check_cupy

        problem = check_cupy(cupy_module)
        if problem:
            self._note(problem)
            return
        from .tracers.cupy.tracer import CupyTracer

        tracer = CupyTracer(self.buffer, self.streams, self.stacks, scope=self.scope, memory=self.memory)
        self.tracers["cupy"] = tracer
        tracer.start(cupy_module)

    def _attach_hooks(self, module) -> None:
        if not self.active:
            return
        hooks = load_hooks("transformers")
        if hooks is None:
            self._note("the transformers hooks could not be loaded: races are still found, without cache labels")
            return
        hooks.install(self, module)

    def _note(self, text: str, level: str = "warning") -> None:
        self.buffer.events.append((E.NOTE, level, text))
        if text not in self.problems:
            self.problems.append(text)
            if self.echo:
                print(f"streamsan: {text}", file=sys.stderr)

    def _join(self, outer: "Session") -> "Session":
        """Start as a part of ``outer``: its tracers trace, its analyzer (if it has one) finds."""
        self._outer = outer
        self.tracers, self.buffer, self.streams, self.stacks = outer.tracers, outer.buffer, outer.streams, outer.stacks
        self.memory = outer.memory
        note = JOINED if outer.analyzes else JOINED_RECORDING
        if self.writer is not None:  # (its events are in the active session's trace, after their definitions)
            self.writer.close()
            os.unlink(self.writer.path)
            self.writer = None
            note += f"; no trace is written to {self._trace_path}"
        if outer.analyzes:
            self._counts_before = {f.fingerprint: f.count for f in outer.findings}
        else:
            self.problems.append(JOINED_RECORDING)
        if self.echo and note not in _said:
            _said.add(note)
            print(f"streamsan: {note}", file=sys.stderr)
        self.active = True
        return self

    def _region_findings(self) -> list:
        """The active session's findings that occurred since this one joined, each counted over that span."""
        if not self._outer.analyzes:
            return []
        out = []
        for f in self._outer.findings:
            n = f.count - self._counts_before.get(f.fingerprint, 0)
            if n > 0:
                f = copy.copy(f)
                f.count = n
                out.append(f)
        return out

    def stop(self) -> None:
        global _current
        if not self.active:
            return
        if self._outer is not None:
            self._region = self._region_findings()
            self.active = False
            return
        self.active = False
        for tracer in list(self.tracers.values()):
            try:
                tracer.stop()
            except Exception as e:
                self.problems.append(f"tracer did not stop cleanly: {e}")
        torch_tracer = self.tracers.get("torch")
        if ("torch" in sys.modules and not self._torch_unsupported  # that note said why already
                and (torch_tracer is None or not torch_tracer.saw_cuda)):
            self._note_no_cuda()
        self.buffer.flush()
        if self._helper is not None:
            helper, self._helper = self._helper, None
            a, problems = helper.finish()
            self._add_problems(problems, helper.problem)
            self._analyzer = a if a is not None else Analyzer()
        if self.writer is not None:
            extra = {"environment": self._environment()}
            # A batch the buffer handed out but the writer never wrote (a KeyboardInterrupt inside a flush):
            # the trace must not claim to be complete.
            lost = self.buffer.total - self.writer.events
            if lost > 0:
                extra["lost"] = lost
            self.writer.close(extra)
        if _current is self:
            _current = None

    def _note_no_cuda(self) -> None:
        torch = sys.modules.get("torch")
        try:
            available = bool(torch.cuda.is_available())
        except Exception:
            available = False
        if not available:
            self._note("no CUDA device is available: nothing could be checked (the program ran unchanged)")

    def _environment(self) -> dict:
        try:
            from .report.environment import collect_environment

            return collect_environment(import_missing=False)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def __enter__(self) -> "Session":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ hook API
    @property
    def torch_tracer(self):
        return self.tracers.get("torch")

    # ------------------------------------------------------------------ results
    @property
    def findings(self) -> list:
        if self._outer is not None:
            return self._region_findings() if self.active else list(self._region)
        if self.active:
            self.buffer.flush()
        a = self.analyzer
        return a.sorted_findings() if a is not None else []

    def report(self, command=None) -> dict:
        from .report.build import build_report
        from .report.environment import collect_environment

        if self.active:
            self.buffer.flush()
        cmd = list(command) if command is not None else list(getattr(sys, "orig_argv", sys.argv))
        problems = self.problems if self._outer is None else [*self._outer.problems, *self.problems]
        return build_report(self.analyzer, command=cmd, environment=collect_environment(),
                            complete=self.complete, problems=tuple(problems))

    @property
    def complete(self) -> bool:
        """Whether every event was analyzed (no analyzer error, no helper lost) and every tracer traced to the end
        (none stopped on a bug of its own). A session that joined one that only records analyzed nothing."""
        if self._outer is not None:
            return self._outer.analyzes and self._outer.complete
        return not any(p.startswith(INCOMPLETE_PREFIXES) for p in self.problems) and not any(
            getattr(t, "stopped_on_bug", False) for t in self.tracers.values())

    def save(self, path: str) -> str:
        import json

        with open(path, "w") as f:
            json.dump(self.report(), f, indent=2)
        return path

    def _repr_html_(self) -> str:
        from .report.render_html import render_session_html

        return render_session_html(self.report())


class _Region:
    """An analyzer as a joined session sees it: the active session's, with the joined session's findings."""

    def __init__(self, analyzer, findings: list):
        self._analyzer = analyzer
        self._findings = findings

    def __getattr__(self, name):
        return getattr(self._analyzer, name)

    def sorted_findings(self) -> list:
        return sorted(self._findings, key=lambda f: (f.previous.seq, f.current.seq))


JOINED = ("a streamsan session is already active in this process: this one joins it (its findings are the "
          "active session's, over this one's span)")
JOINED_RECORDING = ("this process is traced by streamsan wrap: this session joins it, and the findings are in "
                    "wrap's report")
_said: set = set()  # the join notes and environment warnings said in this process (each once)
_enabled: list = []  # the sessions enable() started, oldest first
_current: Session | None = None


def load_hooks(name: str):
    """The hook module ``streamsan.hooks.<name>``, or None if there is none of that name."""
    import importlib

    full = f"streamsan.hooks.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name != full:
            raise
    return None


def watch(scope: str = "full", trace: str | None = None, helper: bool = True) -> Session:
    """``with streamsan.watch() as s:`` traces and analyzes the block; ``trace`` also records a trace file.
    ``helper``: analyze in a helper process, on another core (``False``: in this process)."""
    return Session(scope=scope, trace_path=trace, helper=helper)


def enable(scope: str = "full", trace: str | None = None, helper: bool = True) -> Session:
    """Start tracing until :func:`disable` (or the end of the process)."""
    s = Session(scope=scope, trace_path=trace, helper=helper).start()
    atexit.register(s.stop)
    _enabled.append(s)
    return s


def disable() -> Session | None:
    """Stop the session that :func:`enable` started last (else the active one); returns it (its findings stay
    readable)."""
    s = _enabled.pop() if _enabled else _current
    if s is not None:
        s.stop()
    return s


def current() -> Session | None:
    return _current


# ---------------------------------------------------------------------- streamsan wrap, child side
def start_from_env() -> Session | None:
    """Start recording for ``streamsan wrap`` if ``STREAMSAN_SESSION_DIR`` is set; never raises."""
    d = os.environ.get("STREAMSAN_SESSION_DIR")
    if not d or _current is not None:
        return None
    scope = os.environ.get("STREAMSAN_SCOPE", "full")
    if scope not in SCOPES:
        scope = "full"
    s = Session(scope=scope, trace_path=os.path.join(d, f"trace-{os.getpid()}.sstrace"), analyze=False,
                header={"command": list(getattr(sys, "orig_argv", sys.argv)), "scope": scope}, echo=False,
                compress_trace=False)  # read once, by the wrapping process: not worth the program's time
    s.start()
    _install_exit_handlers(s)
    return s


def _writing(frame) -> bool:
    """Whether the interrupted frame is inside the code that writes the trace (or stops the session)."""
    from .trace import TraceWriter

    codes = {EventBuffer.flush.__code__, TraceWriter.write.__code__, TraceWriter._frame.__code__,
             TraceWriter.close.__code__, Session.stop.__code__}
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _install_exit_handlers(s: Session) -> None:
    atexit.register(s.stop)
    real_exit = os._exit

    def _exit(code):
        try:
            s.stop()
        finally:
            real_exit(code)

    os._exit = _exit

    def on_signal(signum, frame):
        # The handler runs in the main thread between two bytecodes. If that thread was writing the trace (the
        # buffer's lock held, a frame half written), stopping would wait for the lock forever: die of the
        # signal at once instead, the trace without its end mark (replay reports it incomplete).
        if not _writing(frame):
            s.stop()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, on_signal)

    def after_fork_in_child():
        # The child must not write into the parent's trace: it gets its own file and fresh tracer state.
        global _current
        for t in s.tracers.values():
            t.running = False
        s.buffer.events = []
        s.active = False
        _current = None
        start_from_env()

    os.register_at_fork(after_in_child=after_fork_in_child)
