"""A report as one self-contained HTML page (inline CSS and SVG, no external assets): the headline (never "no
races found" for a report that is incomplete or checked nothing), the warnings, the summary table, then each
finding with its timeline picture (at its own size, in a scrolling box), missing edge, fix and stacks, the
suppressed findings, the notes and the environment. :func:`render_session_html` is the compact fragment a
notebook shows for a Session, warnings included."""

from __future__ import annotations

from html import escape

from .advice import agent_text
from .confirmation import confirmation_text
from .environment import environment_rows
from .render_svg import render_svg
from .render_text import action, count_text, memory_text, totals_text
from .timeline import picture
from .verdict import PASSED, RACES_FOUND, headline, verdict

CSS = """
.ss{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#111827;max-width:1100px}
.ss h1{font-size:22px;margin:0 0 4px}.ss h2{font-size:17px;margin:0 0 6px}
.ss code,.ss pre{font:12.5px/1.4 ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace}
.ss code{background:#f3f4f6;border-radius:3px;padding:0 3px}
.ss pre{background:#f9fafb;border:1px solid #e5e7eb;border-radius:4px;padding:8px;overflow-x:auto;margin:4px 0}
.ss table{border-collapse:collapse;margin:8px 0 16px}
.ss th,.ss td{border:1px solid #e5e7eb;padding:4px 8px;text-align:left;vertical-align:top}
.ss th{background:#f9fafb}.ss td.n{text-align:right}
.ss .finding{border:1px solid #e5e7eb;border-left:4px solid #dc2626;border-radius:6px;padding:12px 16px;margin:16px 0}
.ss .pic{overflow-x:auto;margin:8px 0 2px}.ss .pic svg{max-width:none}.ss .legend{color:#6b7280;font-size:12px;margin:0 0 8px}
.ss dl{display:grid;grid-template-columns:max-content 1fr;gap:3px 14px;margin:8px 0}
.ss dt{font-weight:600;color:#374151}.ss dd{margin:0}
.ss .warn{background:#fef3c7;border:1px solid #f59e0b;border-radius:4px;padding:6px 10px}
.ss .ok{color:#15803d;font-weight:600}.ss summary{cursor:pointer;color:#1d4ed8}
"""
LEGEND = ("Blue: the earlier access; orange: the later access; grey: sync events. Solid arrows: ordering that "
          "exists; dashed red arrow: the missing edge.")
NO_TIMELINE = " This report holds no sync events for it (reports replayed from a trace do)."


def _code(text) -> str:
    """Escaped text whose `backticked` parts become <code>."""
    parts = str(text).split("`")
    return "".join(f"<code>{escape(p)}</code>" if i % 2 else escape(p) for i, p in enumerate(parts))


def _access(a: dict) -> str:
    ctx = f" <i>({escape(a['context'])})</i>" if a.get("context") else ""
    return (f"{escape(action(a))} on {escape(agent_text(a['agent']))} at <code>{escape(a['location'])}</code>"
            f"{ctx}")


def _memory_short(m: dict) -> str:
    return escape(m.get("label") or m.get("what") or m["start"])


def _table(races: list, link: bool) -> str:
    rows = ["<table><tr><th>#</th><th>Kind</th><th>Later access</th><th>Earlier access</th><th>Memory</th>"
            "<th>Count</th></tr>"]
    for i, r in enumerate(races, 1):
        n = f'<a href="#ss-f{i}">{i}</a>' if link else str(i)
        rows.append(f'<tr><td class="n">{n}</td><td>{escape(r["kind"])}</td><td>{_access(r["access"])}</td>'
                    f'<td>{_access(r["previous_access"])}</td><td>{_memory_short(r["memory"])}</td>'
                    f'<td class="n">{r["count"]}</td></tr>')
    return "".join(rows) + "</table>"


def _picture(i: int, r: dict) -> str:
    legend = LEGEND + ("" if r.get("timeline") else NO_TIMELINE)
    return f'<div class="pic">{render_svg(picture(r), str(i))}</div><p class="legend">{escape(legend)}</p>'


def _stack(title: str, a: dict) -> str:
    frames = a.get("stack") or a.get("stack_full") or []
    lines = [f'File "{f["file"]}", line {f["line"]}, in {f["function"]}' for f in reversed(frames)]
    body = "\n".join(["Stack (most recent call last):", *lines]) if frames else "(no stack recorded)"
    return f"<details><summary>{escape(title)}</summary><pre>{escape(body)}</pre></details>"


def _site(s) -> str:
    if not s:
        return "unknown (streamsan did not see it allocated)"
    ctx = f" <i>({escape(s['context'])})</i>" if s.get("context") else ""
    return f"<code>{escape(s['location'] or 'unknown location')}</code> on {escape(agent_text(s['owner']))}{ctx}"


def _finding(i: int, r: dict) -> str:
    cur, prev, alloc = r["access"], r["previous_access"], r["allocation"]
    rows = [("Memory", escape(memory_text(r["memory"]))), ("Later access", _access(cur)),
            ("Earlier access", _access(prev)), ("Allocated at", _site(alloc["site"]))]
    if alloc.get("previous_life"):
        reused = "really reused on this run" if alloc.get("reused") else "not reused on this run"
        rows.append(("Earlier allocation", f"{_site(alloc['previous_life'])}; {reused}"))
    rows += [("Missing edge", _code(r["missing_edge"])), ("Fix", _code(r["fix"]))]
    if r.get("confirmation"):
        rows.append(("Confirmation", _code(confirmation_text(r["confirmation"]))))
    rows += [("Occurrences", f"{r['count']} · fingerprint <code>{escape(r['fingerprint'])}</code>")]
    if r.get("tests"):
        rows.append(("Tests", ", ".join(f"<code>{escape(t)}</code>" for t in r["tests"])))
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    stacks = (_stack(f"Stack of the later access: {action(cur)} at {cur['location']}", cur)
              + _stack(f"Stack of the earlier access: {action(prev)} at {prev['location']}", prev))
    return (f'<section class="finding" id="ss-f{i}"><h2>{i}. {escape(r["kind"])}: {escape(cur["op"])} at '
            f'<code>{escape(cur["location"])}</code> vs {escape(prev["op"])} at <code>{escape(prev["location"])}'
            f'</code></h2>{_picture(i, r)}<dl>{dl}</dl>{stacks}</section>')


def _suppressed(report: dict) -> str:
    items = report.get("suppressed") or []
    if not items:
        return ""
    rows = "".join(f'<tr><td>{escape(r["kind"])}</td><td>{_access(r["access"])}</td><td class="n">{r["count"]}'
                   f'</td><td><code>{escape(r["suppression"]["rule"])}</code></td>'
                   f'<td>{escape(r["suppression"]["reason"])}</td></tr>' for r in items)
    return (f"<h2>Suppressed ({len(items)})</h2><table><tr><th>Kind</th><th>Later access</th><th>Count</th>"
            f"<th>Rule</th><th>Reason</th></tr>{rows}</table>")


def _status(report: dict) -> str:
    """The totals, then every reason not to read a report without races as a pass (incomplete, a warning
    note such as "no CUDA device: nothing could be checked"), each as a warning box."""
    v = verdict(report)
    out = [f'<p{" class=ok" if v == PASSED else ""}>{escape(totals_text(report))}</p>']
    if not report.get("complete", True):
        out += [f'<p class="warn">Incomplete: {escape(p)}</p>' for p in report.get("problems") or
                ["events may be missing"]]
    out += [f'<p class="warn">Warning: {escape(n["text"])}</p>' for n in report.get("notes", [])
            if n.get("level") == "warning"]
    if v not in (PASSED, RACES_FOUND) and len(out) == 1:
        out.append(f'<p class="warn">{escape(headline(report)[0].upper() + headline(report)[1:])}.</p>')
    return "".join(out)


def _environment(report: dict) -> str:
    rows = [f"<tr><th>{escape(k)}</th><td>{f'<code>{escape(v)}</code>' if v else 'unknown'}</td></tr>"
            for k, v in environment_rows(report)]
    return f"<details><summary>Environment</summary><table>{''.join(rows)}</table></details>"


def _title(report: dict) -> str:
    return f"streamsan: {headline(report)}"


def render_html(report: dict) -> str:
    """The report as a complete HTML document."""
    races = report["races"]
    notes = "".join(f"<li>{escape(n['level'])}: {escape(n['text'])}</li>" for n in report.get("notes", [])
                    if n.get("level") != "warning")  # (warnings are said at the top)
    body = [f"<h1>{escape(_title(report))}</h1>", _status(report)]
    if races:
        body.append(_table(races, link=True))
        body += [_finding(i, r) for i, r in enumerate(races, 1)]
    body.append(_suppressed(report))
    if notes:
        body.append(f"<h2>Notes</h2><ul>{notes}</ul>")
    body.append(_environment(report))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(_title(report))}</title>'
            f'<style>{CSS}</style></head><body><div class="ss">{"".join(body)}</div></body></html>\n')


def render_session_html(report: dict) -> str:
    """A compact fragment for a notebook: totals, the summary table, each finding's picture and fix."""
    parts = [f"<style>{CSS}</style>", f"<h2>{escape(_title(report))}</h2>", _status(report)]
    if report["races"]:
        parts.append(_table(report["races"], link=False))
    for i, r in enumerate(report["races"], 1):
        parts.append(f'<h2>{i}. {escape(r["kind"])} ×{r["count"]}</h2>{_picture(i, r)}'
                     f'<p><b>Fix:</b> {_code(r["fix"])}</p>')
    if report.get("suppressed"):
        parts.append(f"<p>{count_text(len(report['suppressed']), 'suppressed finding')} not shown.</p>")
    return f'<div class="ss">{"".join(parts)}</div>'
