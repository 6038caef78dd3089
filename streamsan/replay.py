"""Replay a trace file through the analyzer and build its report.

A damaged or truncated trace still yields a report of the events before the damage (``complete`` false, the
problem in ``problems``). Anything else wrong with the file raises :class:`~streamsan.trace.TraceError` with a
one-line message; so do events that the analyzer takes but that would make a report not following
``schema.json``.
"""

from __future__ import annotations

import gc
import logging
import os

from .analysis.analyzer import Analyzer
from .report.build import build_report
from .report.io import schema_problem
from .report.render_text import count_text
from .report.syncs import attach_timelines, collect_timelines
from .trace import TraceError, TraceReader, validate_batch

log = logging.getLogger("streamsan")

_ANALYZER_ERRORS = (TypeError, IndexError, KeyError, ValueError, AttributeError)


def _command(header: dict) -> list:
    cmd = header.get("command")
    if isinstance(cmd, str):
        return [cmd]
    return [str(c) for c in cmd] if isinstance(cmd, list) else []


def _environment(env) -> dict:
    """The trace's environment, without the entries of the wrong type (a report must follow schema.json) and
    without the command line that older traces kept there too (the report has it once, as ``command``)."""
    if not isinstance(env, dict):
        return {}
    return {k: v for k, v in env.items() if k != "command" and schema_problem({k: v}, "environment") is None}


def _explain(path: str, name: str, why: str) -> TraceError:
    """The error for a trace whose events the analyzer took but that make no valid report: the first invalid
    event (read again and validated, slowly), else ``why``."""
    first = 0
    for batch in TraceReader(path).batches():
        try:
            validate_batch(batch, first)
        except TraceError as bad:
            return TraceError(f"{name}: invalid {bad}")
        first += len(batch)
    return TraceError(f"{name}: the events make no valid report ({why})")


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
    elif type(reader.footer.get("lost")) is int:
        problems.append(f"{name}: {reader.footer['lost']} events were lost when the traced process was "
                        f"interrupted while writing them")
    header = reader.header
    env = reader.footer.get("environment") or header.get("environment")
    command = _command(header)
    process = None
    if with_process:
        pid = header.get("pid")
        process = {"pid": pid if type(pid) is int else None, "command": command,
                   "trace": os.path.basename(path)}
    # The analyzer takes events without validating them (only a failing batch is validated): events of the
    # right shape but the wrong types (a name that is a number, a handle that is a string) reach the report.
    # Check it against schema.json and name the culprit rather than hand renderers a malformed report.
    try:
        report = build_report(analyzer, command=command, environment=_environment(env), complete=not problems,
                              problems=problems, process=process)
        if analyzer.findings:
            attach_timelines(report, collect_timelines(TraceReader(path).batches(), analyzer))
    except _ANALYZER_ERRORS + (OverflowError,) as e:
        raise _explain(path, name, f"{type(e).__name__}: {e}") from None
    problem = schema_problem(report)
    if problem:
        raise _explain(path, name, problem)
    log.debug("%s: %s, %s", name, count_text(analyzer.seq, "event"), count_text(len(analyzer.findings), "finding"))
    return report
