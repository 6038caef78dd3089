"""A report as a GitHub-flavoured Markdown bug-tracker comment: a summary table, each finding with its missing
edge, fix and both stacks folded in ``<details>``, and the environment."""

from __future__ import annotations

from html import escape

from .advice import agent_text
from .confirmation import confirmation_text
from .environment import environment_rows
from .render_text import action, totals_text


def _code(s) -> str:
    return "`" + str(s).replace("`", "'") + "`"


def _prose(text) -> str:
    """A sentence with `code` spans (a fix, a missing edge): escaped like every other text, its code spans
    kept as they are (Markdown shows them literally)."""
    parts = str(text).split("`")
    return "`".join(p if i % 2 else escape(p) for i, p in enumerate(parts))


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _agent(agent: dict) -> str:
    if agent["kind"] == "host":
        return "the host"
    dev = f"cuda:{agent['device']}" if agent.get("device") is not None else "device unknown"
    if not agent.get("role"):
        return f"stream {_code(agent['stream'])} ({dev})"
    return f"{agent_text(agent)} (stream {_code(agent['stream'])}, {dev})"


def _action(a: dict) -> str:
    return _code(action(a)) if a["op"] == "allocation" else f"{a['type']} {_code(a['op'])}"


def _access_short(a: dict) -> str:
    return f"{_action(a)} on {agent_text(a['agent'])} at {_code(a['location'])}"


def _memory(m: dict) -> str:
    parts = [m["space"] if m["device"] is None else f"{m['space']} cuda:{m['device']}",
             f"{_code(m['start'])}–{_code(m['end'])} ({m['bytes']} bytes)"]
    if m.get("what"):
        parts.append(_code(m["what"]))
    if m.get("label"):
        parts.append(f"label {_code(m['label'])}")
    return ", ".join(parts)


def _stack_block(title: str, a: dict) -> list:
    frames = a.get("stack") or a.get("stack_full") or []
    hidden = len(a.get("stack_full", [])) - len(frames)
    body = ["Stack (most recent call last):"] + [
        f'  File "{f["file"]}", line {f["line"]}, in {f["function"]}' for f in reversed(frames)]
    if not frames:
        body = ["(no stack recorded)"]
    if hidden > 0:
        body.append(f"  ({hidden} library frame{'s' if hidden > 1 else ''} hidden)")
    return [f"<details><summary>{escape(title)}</summary>", "", "```text", *body, "```", "", "</details>", ""]


def _site(s) -> str:
    if not s:
        return "unknown (streamsan did not see it allocated)"
    out = f"{_code(s['location'] or 'unknown location')} on {agent_text(s['owner'])}"
    if s.get("context"):
        out += f" ({escape(s['context'])})"
    return out


def _finding(i: int, r: dict) -> list:
    cur, prev, alloc = r["access"], r["previous_access"], r["allocation"]
    lines = [
        f"### {i}. {r['kind']}: {_code(cur['op'])} at {_code(cur['location'])} vs "
        f"{_code(prev['op'])} at {_code(prev['location'])}",
        "",
        f"- **Memory:** {_memory(r['memory'])}",
        f"- **Later access:** {_action(cur)} on {_agent(cur['agent'])} at "
        f"{_code(cur['location'])}" + (f" — {escape(cur['context'])}" if cur.get("context") else ""),
        f"- **Earlier access:** {_action(prev)} on {_agent(prev['agent'])} at "
        f"{_code(prev['location'])}" + (f" — {escape(prev['context'])}" if prev.get("context") else ""),
        f"- **Allocated at:** {_site(alloc['site'])}",
    ]
    if alloc.get("previous_life"):
        reused = "the memory was really reused on this run" if alloc.get("reused") else "not reused on this run"
        lines.append(f"- **Earlier allocation:** {_site(alloc['previous_life'])}; {reused}")
    lines += [
        f"- **Missing edge:** {_prose(r['missing_edge'])}",
        f"- **Fix:** {_prose(r['fix'])}",
        *([f"- **Confirmation:** {_prose(confirmation_text(r['confirmation']))}"] if r.get("confirmation") else []),
        f"- **Occurrences:** {r['count']} · fingerprint {_code(r['fingerprint'])}",
    ]
    if r.get("tests"):
        lines.append(f"- **Tests:** {', '.join(_code(t) for t in r['tests'])}")
    lines.append("")
    lines += _stack_block(f"Stack of the later access: {action(cur)} at {cur['location']}", cur)
    lines += _stack_block(f"Stack of the earlier access: {action(prev)} at {prev['location']}", prev)
    return lines


def _suppressed(items: list) -> list:
    if not items:
        return []
    lines = [f"### Suppressed ({len(items)})", "", "| Kind | Later access | Count | Rule | Reason |",
             "|---|---|---:|---|---|"]
    for r in items:
        rule = r["suppression"]
        lines.append(f"| {r['kind']} | {_cell(_access_short(r['access']))} | {r['count']} | "
                     f"{_cell(_code(rule['rule']))} | {_cell(escape(rule['reason']))} |")
    return lines + [""]


def _environment(report: dict) -> list:
    rows = [f"| {k} | {_cell(_code(v)) if v else 'unknown'} |" for k, v in environment_rows(report)]
    return ["<details><summary>Environment</summary>", "", "| | |", "|---|---|", *rows, "", "</details>", ""]


def render_markdown(report: dict) -> str:
    """The report as Markdown ending in a newline."""
    races = report["races"]
    s = report["summary"]
    title = f"{s['races']} CUDA stream race{'' if s['races'] == 1 else 's'} found" if races else "no races found"
    lines = [f"## streamsan: {title}", "", totals_text(report).removeprefix("streamsan: "), ""]
    if not report.get("complete", True):
        problems = report.get("problems") or ["events may be missing"]
        lines += [f"> **Incomplete:** {escape(p)}  " for p in problems] + [""]
    if races:
        lines += ["| # | Kind | Later access | Earlier access | Memory | Count |", "|---:|---|---|---|---|---:|"]
        for i, r in enumerate(races, 1):
            mem = r["memory"].get("label") or r["memory"].get("what") or r["memory"]["start"]
            lines.append(f"| {i} | {r['kind']} | {_cell(_access_short(r['access']))} | "
                         f"{_cell(_access_short(r['previous_access']))} | {_cell(_code(mem))} | {r['count']} |")
        lines.append("")
        for i, r in enumerate(races, 1):
            lines += _finding(i, r)
    lines += _suppressed(report.get("suppressed", []))
    if report.get("notes"):
        lines += ["### Notes", ""] + [f"- {n['level']}: {escape(n['text'])}" for n in report["notes"]] + [""]
    lines += _environment(report)
    return "\n".join(lines)
