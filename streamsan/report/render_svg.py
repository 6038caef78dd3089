"""A finding's timeline picture (:mod:`.timeline`) as inline SVG: one lane per agent, a box per step, solid
arrows for the sync edges that exist and a dashed red arrow for the missing one."""

from __future__ import annotations

from html import escape

from .timeline import Picture, lane_label

LABEL_W, COL_W, LANE_H, TOP = 170, 132, 64, 26
SIZES = {"earlier": (120, 38), "later": (120, 38)}
SYNC_SIZE = (106, 24)
COLORS = {"earlier": ("#dbeafe", "#1d4ed8"), "later": ("#ffedd5", "#c2410c")}
SYNC_COLORS = ("#f3f4f6", "#6b7280")
EDGE, MISSING = "#374151", "#dc2626"


def _fit(text: str, width: int, px: float = 6.3, tail: bool = False) -> str:
    """Text cut to about ``width`` pixels (``px`` per character): its end kept when ``tail`` (file:line)."""
    n = max(4, int(width / px))
    if len(text) <= n:
        return text
    return "…" + text[-(n - 1):] if tail else text[:n - 1] + "…"


def _center(lane: int, x: int) -> tuple:
    return LABEL_W + x * COL_W + COL_W / 2, TOP + lane * LANE_H + LANE_H / 2


def _box(step) -> tuple:
    return SIZES.get(step.role, SYNC_SIZE)


def _end(point: tuple, boxes: dict, toward: tuple) -> tuple:
    """Where an arrow leaves or reaches ``point``: the side of its box facing ``toward``."""
    cx, cy = _center(*point)
    tx, ty = _center(*toward)
    w, h = boxes.get(point, (0, 0))
    if point[0] == toward[0]:
        return (cx + w / 2, cy) if tx > cx else (cx - w / 2, cy)
    return (cx, cy + h / 2) if ty > cy else (cx, cy - h / 2)


def render_svg(pic: Picture, uid: str) -> str:
    """The picture as an ``<svg>`` element; ``uid`` keeps its marker ids unique in a page."""
    width = LABEL_W + pic.columns * COL_W + 16
    height = TOP + len(pic.lanes) * LANE_H + 8
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="ss-timeline" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" '
           'aria-label="timeline of the two racing operations">',
           "<defs>"]
    for name, color in (("a", EDGE), ("m", MISSING)):
        out.append(f'<marker id="ss-{name}{uid}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                   f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{color}"/>'
                   "</marker>")
    out.append("</defs>")
    out.append(f'<text x="{width - 12}" y="14" text-anchor="end" font-size="11" fill="#6b7280">trace order →</text>')
    for i, agent in enumerate(pic.lanes):
        _, y = _center(i, 0)
        name = "host" if agent["kind"] == "host" else agent.get("role") or "stream"
        sub = "" if agent["kind"] == "host" else f"{agent['stream']}" + (
            f" · cuda:{agent['device']}" if agent.get("device") is not None else "")
        out.append(f'<line x1="{LABEL_W - 8}" y1="{y}" x2="{width - 8}" y2="{y}" stroke="#d1d5db"/>')
        out.append(f'<text x="8" y="{y + (0 if sub else 4)}" font-size="12" font-weight="600" fill="#111827">'
                   f'<title>{escape(lane_label(agent))}</title>{escape(_fit(name, LABEL_W - 20, 7.2))}</text>')
        if sub:
            out.append(f'<text x="8" y="{y + 14}" font-size="10" fill="#6b7280">{escape(_fit(sub, LABEL_W - 20))}'
                       "</text>")
    boxes = {(s.lane, s.x): _box(s) for s in pic.steps}
    for e in pic.edges:
        (x1, y1), (x2, y2) = _end(e.src, boxes, e.dst), _end(e.dst, boxes, e.src)
        color, mark = (MISSING, "m") if e.missing else (EDGE, "a")
        dash = ' stroke-dasharray="6 4"' if e.missing else ""
        out.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" stroke-width="2"{dash} '
                   f'marker-end="url(#ss-{mark}{uid})"><title>{escape(e.label)}</title></line>')
        if e.missing:
            out.append(f'<text x="{(x1 + x2) / 2 + 6}" y="{(y1 + y2) / 2 + 4}" font-size="11" fill="{MISSING}" '
                       f'font-weight="600" stroke="#fff" stroke-width="3" paint-order="stroke">missing edge</text>')
    for s in pic.steps:
        cx, cy = _center(s.lane, s.x)
        w, h = _box(s)
        fill, stroke = COLORS.get(s.role, SYNC_COLORS)
        tip = f"{s.label} at {s.where}" if s.where else s.label
        out.append(f'<g><title>{escape(tip)}</title>'
                   f'<rect x="{cx - w / 2}" y="{cy - h / 2}" width="{w}" height="{h}" rx="4" fill="{fill}" '
                   f'stroke="{stroke}" stroke-width="{2 if s.role in COLORS else 1}"/>')
        if s.role in COLORS:
            out.append(f'<text x="{cx}" y="{cy - 3}" text-anchor="middle" font-size="11" font-weight="600" '
                       f'fill="#111827">{escape(_fit(s.label, w - 8))}</text>'
                       f'<text x="{cx}" y="{cy + 11}" text-anchor="middle" font-size="10" fill="#374151">'
                       f'{escape(_fit(s.where, w - 8, 5.8, tail=True))}</text>')
        else:
            out.append(f'<text x="{cx}" y="{cy + 4}" text-anchor="middle" font-size="10" fill="#111827">'
                       f'{escape(_fit(s.label, w - 8, 5.8))}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)
