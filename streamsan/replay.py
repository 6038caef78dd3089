"""Replay a trace file through the analyzer and build its report.

A damaged or truncated trace still yields a report of the events before the damage (``complete`` false, the
problem in ``problems``). Anything else wrong with the file raises :class:`~streamsan.trace.TraceError` with a
one-line message.
"""

from __future__ import annotations

import gc
import logging
import os

from .analyzer import Analyzer
from .report.build import build_report
from .report.syncs import attach_timelines, collect_timelines
from .trace import TraceError, TraceReader, validate_batch

log = logging.getLogger("streamsan")

_ANALYZER_ERRORS = (TypeError, IndexError, KeyError, ValueError, AttributeError)


def _command(header: dict) -> list:
    cmd = header.get("command")
    if isinstance(cmd, str):
        return [cmd]
    return [str(c) for c in cmd] if isinstance(cmd, list) else []


def _feed(reader, analyzer, name: str, progress) -> None:
    for batch in reader.batches():
        first = analyzer.seq
        try:
            analyzer.feed(batch)
        except _ANALYZER_ERRORS as e:
            try:
                validate_batch(batch, first)
            except TraceError as bad:
                raise TraceError(f"{name}: invalid {bad}") from None
            raise TraceError(f"{name}: event {analyzer.seq} cannot be analyzed ({type(e).__name__}: {e})") from None
        if progress is not None:
            progress(analyzer)


def replay_trace(path: str, *, with_process: bool = False, name: str | None = None, progress=None) -> dict:
    """Analyze the trace at ``path`` and return its report, each finding with its ``timeline`` (a second read
    of the trace up to the last finding). ``with_process``: add a ``processes`` entry (pid, command, trace file
    name) so that the report can be merged with other processes' reports. ``name``: how messages name the
    trace (default: its path). ``progress``: called with the analyzer after each batch."""
    name = name or path
    reader = TraceReader(path)
    analyzer = Analyzer()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the analyzer builds no garbage cycles; collection passes would triple replay time
    try:
        _feed(reader, analyzer, name, progress)
    finally:
        if gc_was_enabled:
            gc.enable()
    analyzer.finish()
    problems = []
    if reader.problem:
        problems.append(f"{name}: {reader.problem} after {reader.events} events (the events before it were "
                        f"analyzed)")
    elif not reader.complete:
        problems.append(f"{name}: the trace has no end mark after {reader.events} events (the traced process "
                        f"did not exit normally)")
    header = reader.header
    env = reader.footer.get("environment") or header.get("environment")
    command = _command(header)
    process = None
    if with_process:
        pid = header.get("pid")
        process = {"pid": pid if type(pid) is int else None, "command": command,
                   "trace": os.path.basename(path)}
    report = build_report(analyzer, command=command, environment=env if isinstance(env, dict) else {},
                          complete=not problems, problems=problems, process=process)
    if analyzer.findings:
        attach_timelines(report, collect_timelines(TraceReader(path).batches(), analyzer))
    log.debug("%s: %d events, %d findings", name, analyzer.seq, len(analyzer.findings))
    return report
