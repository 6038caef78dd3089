"""The output formats of a report, by name: what ``--format`` accepts."""

from __future__ import annotations

import json

FORMATS = ("text", "markdown", "json", "sarif", "html", "perfetto")


def render(report: dict, fmt: str, *, root: str | None = None) -> str:
    """The report in one of :data:`FORMATS`. ``root``: the source root that SARIF paths are made relative to."""
    if fmt == "json":
        return json.dumps(report, indent=2) + "\n"
    if fmt == "markdown":
        from .render_markdown import render_markdown
        return render_markdown(report)
    if fmt == "sarif":
        from .render_sarif import render_sarif
        return json.dumps(render_sarif(report, root=root), indent=2) + "\n"
    if fmt == "html":
        from .render_html import render_html
        return render_html(report)
    if fmt == "perfetto":
        from .render_perfetto import render_perfetto
        return json.dumps(render_perfetto(report)) + "\n"
    if fmt == "text":
        from .render_text import render_text
        return render_text(report)
    raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
