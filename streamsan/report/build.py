"""Build a JSON report (``streamsan.report/1``, see ``schema.json``) from an analyzer's findings.

The report is plain JSON data: renderers, ``streamsan merge`` and outside tools read only it. Addresses and
stream handles are hex strings; stacks are lists of ``{"file", "line", "function"}``, innermost first.
"""

from __future__ import annotations

import time

from ..events import HOST, PINNED, TRACING_STOPPED
from ..analysis.findings import KINDS, MISSING_RECORD_STREAM
from ..analysis.locations import is_library_frame, location
from . import advice

SCHEMA = "streamsan.report/1"
COUNTERS = ("events", "ops", "host_accesses", "syncs", "allocs", "frees", "streams")


def version() -> str:
    """This streamsan's version."""
    import streamsan
    return streamsan.__version__


def _frames(frames) -> list:
    return [{"file": f[0], "line": f[1], "function": f[2]} for f in frames]


def agent_item(analyzer, a: int) -> dict:
    """An agent (the host or a stream) as a report item."""
    if a == HOST:
        return {"kind": "host", "stream": None, "device": None, "role": "host"}
    info = analyzer.agents[a]
    return {"kind": "stream", "stream": f"{info.handle:#x}", "device": info.device if info.device >= 0 else None,
            "role": info.name or None}


def _access(analyzer, acc, write: bool, loc: str) -> dict:
    frames = analyzer.stacks.get(acc.stack, ())
    return {
        "agent": agent_item(analyzer, acc.agent),
        "type": "write" if write else "read",
        "op": acc.name,
        "location": loc,
        "stack": _frames(f for f in frames if not is_library_frame(f[0])),
        "stack_full": _frames(frames),
        "context": analyzer.contexts.get(acc.ctx) or None,
    }


def _site(analyzer, block) -> dict | None:
    if block is None:
        return None
    frames = analyzer.stacks.get(block.stack, ())
    return {
        "location": location(frames, "") or None,
        "stack": _frames(f for f in frames if not is_library_frame(f[0])),
        "context": analyzer.contexts.get(block.ctx) or None,
        "owner": agent_item(analyzer, block.owner),
        "start": f"{block.start:#x}",
        "bytes": block.size,
        "what": block.what or None,
        "label": block.label or None,
    }


def _memory(f) -> dict:
    """The memory of a finding, described by the life it belongs to (for missing-record-stream, the freed
    tensor's)."""
    blk = f.prev_block if f.kind == MISSING_RECORD_STREAM else (f.block or f.prev_block)
    label = next((b.label for b in (blk, f.prev_block) if b is not None and b.label), "")
    return {
        "space": "pinned-host" if f.space == PINNED else "device",
        "device": None if f.space == PINNED else f.space,
        "start": f"{f.lo:#x}",
        "end": f"{f.hi:#x}",
        "bytes": f.hi - f.lo,
        "what": (blk.what if blk is not None else "") or None,
        "label": label or None,
    }


def race_item(analyzer, f) -> dict:
    """One finding as a report item."""
    prev = _access(analyzer, f.previous, f.prev_write, f.prev_loc)
    cur = _access(analyzer, f.current, f.cur_write, f.cur_loc)
    memory = _memory(f)
    allocation = {
        "site": _site(analyzer, f.block),
        "previous_life": _site(analyzer, f.prev_block),
        "reused": bool(f.reused or (f.prev_block is not None and f.kind != MISSING_RECORD_STREAM)),
    }
    return {
        "kind": f.kind,
        "fingerprint": f.fingerprint,
        "count": f.count,
        "memory": memory,
        "access": cur,
        "previous_access": prev,
        "allocation": allocation,
        "missing_edge": advice.missing_edge(f.kind, prev, cur, allocation),
        "fix": advice.fix(f.kind, prev, cur, memory, allocation),
    }


def summarize(races: list, counters: dict, processes: int | None = None, suppressed: int | None = None) -> dict:
    """The report's ``summary`` from its race items and event counters (and, when given, the number of
    processes and of suppressed findings)."""
    by_kind = dict.fromkeys(KINDS, 0)
    for r in races:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    out = {"races": len(races), "occurrences": sum(r["count"] for r in races), "by_kind": by_kind}
    out.update((k, counters.get(k, 0)) for k in COUNTERS)
    if processes is not None:
        out["processes"] = processes
    if suppressed is not None:
        out["suppressed"] = suppressed
    return out


def build_report(analyzer, *, command, environment, complete=True, problems=(), process=None) -> dict:
    """The report of one analyzed event stream.

    ``command``: the traced command line (a list of strings). ``environment``: a dict (see
    :func:`streamsan.report.environment.collect_environment`). ``complete``: False when events may be missing
    (truncated trace, crashed process; a tracer that stopped on a bug of its own, whose note makes it so too);
    ``problems`` says why, one line each. ``process``: a dict (``pid``,
    ``trace``, ...) describing the traced process; given, the report gets a one-entry ``processes`` list, so
    that reports merged later keep per-process facts.
    """
    stopped = [text for _level, text in analyzer.notes if text.startswith(TRACING_STOPPED)]
    if stopped:  # (the events after the tracer stopped are missing)
        complete = False
        problems = [*problems, *(text for text in stopped if text not in problems)]
    races = [race_item(analyzer, f) for f in analyzer.sorted_findings()]
    counters = dict(analyzer.counts, events=analyzer.seq,
                    streams=sum(1 for a in analyzer.agents if a != HOST))
    report = {
        "schema": SCHEMA,
        "streamsan_version": version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [str(c) for c in command],
        "environment": dict(environment),
        "complete": bool(complete),
        "problems": [str(p) for p in problems],
        "notes": [{"level": level, "text": text} for level, text in analyzer.notes],
        "summary": summarize(races, counters),
        "races": races,
    }
    if process is not None:
        entry = dict(process)
        entry.update(complete=report["complete"], problems=report["problems"], events=counters["events"],
                     races=len(races), occurrences=report["summary"]["occurrences"])
        report["processes"] = [entry]
        report["summary"]["processes"] = 1
    return report
