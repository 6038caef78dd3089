"""A report in the Chrome trace-event format (JSON) that Perfetto and ``chrome://tracing`` open: one process
per finding, one track per agent of its timeline picture (:mod:`.timeline`), the accesses and syncs as
complete events, each sync edge as a flow arrow, the missing edge as a flow in category ``streamsan.missing``
and the racing pair marked by instant events named after the finding's kind.

The time axis is trace order, not time: step N of a picture starts at N * 100 us.
"""

from __future__ import annotations

from .build import version
from .timeline import lane_label, picture

STEP_US, DUR_US = 100, 80


def _finding(pid: int, r: dict, flow_ids) -> list:
    pic = picture(r)
    mem = r["memory"].get("label") or r["memory"].get("what") or r["memory"]["start"]
    out = [{"ph": "M", "pid": pid, "name": "process_name",
            "args": {"name": f"{pid}. {r['kind']} x{r['count']} on {mem}"}},
           {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}]
    for i, agent in enumerate(pic.lanes):
        out += [{"ph": "M", "pid": pid, "tid": i + 1, "name": "thread_name", "args": {"name": lane_label(agent)}},
                {"ph": "M", "pid": pid, "tid": i + 1, "name": "thread_sort_index", "args": {"sort_index": i}}]
    slices = set()
    for s in pic.steps:
        cat = "streamsan.access" if s.role in ("earlier", "later") else "streamsan.sync"
        out.append({"ph": "X", "pid": pid, "tid": s.lane + 1, "ts": s.x * STEP_US, "dur": DUR_US, "name": s.label,
                    "cat": cat, "args": {"role": s.role, "location": s.where}})
        slices.add((s.lane, s.x))
        if cat == "streamsan.access":
            out.append({"ph": "i", "s": "t", "pid": pid, "tid": s.lane + 1, "ts": s.x * STEP_US + DUR_US // 2,
                        "name": r["kind"], "cat": "streamsan.race",
                        "args": {"access": s.role, "fingerprint": r["fingerprint"]}})
    for e in pic.edges:
        for lane, x in (e.src, e.dst):
            if (lane, x) not in slices:  # a flow needs a slice to start or end in
                slices.add((lane, x))
                out.append({"ph": "X", "pid": pid, "tid": lane + 1, "ts": x * STEP_US, "dur": DUR_US,
                            "name": "synchronized", "cat": "streamsan.sync", "args": {}})
        fid = next(flow_ids)
        cat = "streamsan.missing" if e.missing else "streamsan.sync"
        out.append({"ph": "s", "id": fid, "pid": pid, "tid": e.src[0] + 1, "ts": e.src[1] * STEP_US + 1,
                    "name": e.label, "cat": cat})
        out.append({"ph": "f", "bp": "e", "id": fid, "pid": pid, "tid": e.dst[0] + 1, "ts": e.dst[1] * STEP_US + 1,
                    "name": e.label, "cat": cat})
    return out


def render_perfetto(report: dict) -> dict:
    """The trace-event JSON object of a report's findings."""
    flow_ids = iter(range(1, 1 << 31))
    events = []
    for pid, r in enumerate(report["races"], 1):
        events += _finding(pid, r, flow_ids)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": f"streamsan {report.get('streamsan_version') or version()}",
                          "time_axis": "trace order (step N at N * 100 us), not real time"}}
