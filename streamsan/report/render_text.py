"""A short human summary of a report, for a terminal: totals, then one paragraph per finding."""

from __future__ import annotations

from .advice import agent_text
from .confirmation import confirmation_text, counts_text


def count_text(n: int, noun: str) -> str:
    """``1 event``, ``2 events``: a count and its noun, singular or plural."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def memory_text(m: dict) -> str:
    """``pinned-host memory 0x1000-0x2000 (4096 bytes, cache.layers[3].keys, bfloat16[1, 8])``."""
    where = "pinned-host memory" if m["space"] == "pinned-host" else f"device memory (cuda:{m['device']})"
    extra = ", ".join(x for x in (m.get("label"), m.get("what")) if x)
    return f"{where} {m['start']}-{m['end']} ({m['bytes']} bytes{', ' + extra if extra else ''})"


def action(a: dict) -> str:
    """``write aten::copy_``, or ``allocation`` for the allocation of a missing-record-stream finding."""
    return "allocation" if a["op"] == "allocation" else f"{a['type']} {a['op']}"


def access_text(a: dict) -> str:
    """``write aten::copy_ on prefetch_stream (0x7f00) at run.py:12``."""
    agent = a["agent"]
    handle = f" ({agent['stream']})" if agent["kind"] == "stream" and agent.get("role") else ""
    ctx = f"  [{a['context']}]" if a.get("context") else ""
    return f"{action(a)} on {agent_text(agent)}{handle} at {a['location']}{ctx}"


def finding_text(i: int, r: dict) -> str:
    """The one-paragraph summary of the ``i``-th finding (no trailing newline)."""
    return "\n".join([
        f"[{i}] {r['kind']} x{r['count']} on {memory_text(r['memory'])}",
        f"    earlier: {access_text(r['previous_access'])}",
        f"    later:   {access_text(r['access'])}",
        f"    fix: {r['fix']}",
    ] + ([f"    {confirmation_text(r['confirmation'])}"] if r.get("confirmation") else []))


def suppressed_text(r: dict) -> str:
    """``streamsan: suppressed: device-device x3 at run.py:7 by kind:device-device (known bug)``."""
    rule = r["suppression"]
    return (f"streamsan: suppressed: {r['kind']} x{r['count']} at {r['access']['location']} by {rule['rule']} "
            f"({rule['reason']})")


def totals_text(report: dict) -> str:
    s = report["summary"]
    scope = ", ".join((count_text(s["events"], "event"), count_text(s["ops"], "stream op"),
                       count_text(s["streams"], "stream")))
    if s.get("processes", 0) > 1:
        scope += f", {s['processes']} processes"
    if s.get("suppressed"):
        scope += f"; {s['suppressed']} suppressed"
    if not s["races"]:
        return f"streamsan: no races found ({scope})."
    kinds = ", ".join(f"{n} {k}" for k, n in s["by_kind"].items() if n)
    return (f"streamsan: {count_text(s['races'], 'race')} found, {count_text(s['occurrences'], 'occurrence')} "
            f"({kinds}; {scope}).")


def render_text(report: dict) -> str:
    """The summary as text ending in a newline."""
    lines = [totals_text(report)]
    if not report.get("complete", True):
        problems = report.get("problems") or ["events may be missing"]
        lines += [f"streamsan: warning: the report is incomplete: {p}" for p in problems]
    for n in report.get("notes", []):
        lines.append(f"streamsan: {n['level']}: {n['text']}")
    lines += [suppressed_text(r) for r in report.get("suppressed", [])]
    confirmed = counts_text(report)
    if confirmed:
        lines.append(f"streamsan: {confirmed}")
    for i, r in enumerate(report["races"], 1):
        lines += ["", finding_text(i, r)]
    return "\n".join(lines) + "\n"
