"""A finding as a timeline picture, for the HTML and Perfetto renderers, built from its race item alone.

Lanes are agents: the earlier access's, the later access's, then any other stream a sync names, the host
last. Steps are the two accesses and the item's ``timeline`` syncs, one column each in trace order (without a
timeline: the two accesses only). Edges are the ordering that exists (an event record to its wait or event
sync, a stream or device to the host that synchronized with it) and the missing one (earlier to later
access).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .render_text import action


@dataclass
class Step:
    lane: int
    x: int
    label: str
    role: str  # "earlier", "later" or the sync's type
    where: str  # its location (file:line), or ""


@dataclass
class Edge:
    src: tuple  # (lane, x)
    dst: tuple
    missing: bool
    label: str


@dataclass
class Picture:
    lanes: list = field(default_factory=list)  # agent dicts
    steps: list = field(default_factory=list)
    edges: list = field(default_factory=list)
    columns: int = 0


def lane_label(agent: dict) -> str:
    """``host``, ``prefetch_stream (0x55d1f00)``, ``stream 0x77aa00``."""
    if agent["kind"] == "host":
        return "host"
    return f"{agent['role']} ({agent['stream']})" if agent.get("role") else f"stream {agent['stream']}"


def _key(agent: dict) -> tuple:
    return (agent["kind"], agent.get("stream"), agent.get("device"))


def _sync_label(s: dict) -> str:
    t = s["type"]
    if t in ("event-record", "event-wait", "event-sync"):
        return f"{t.replace('-', ' ')} {s['event']}"
    if t == "device-sync":
        return f"device sync cuda:{s['device']}"
    if t == "stream-sync":
        return "synchronize()"
    return "free (old life)"


def picture(race: dict) -> Picture:
    """The picture of one race item."""
    prev, cur = race["previous_access"], race["access"]
    tl = race.get("timeline") or {"previous_seq": 0, "seq": 1, "syncs": []}
    agents = [prev["agent"], cur["agent"]]
    for s in tl["syncs"]:
        agents += [a for a in (s.get("waits_for"), s["agent"]) if a is not None and a["kind"] == "stream"]
    agents += [s["agent"] for s in tl["syncs"] if s["agent"]["kind"] == "host"][:1]
    pic = Picture()
    index: dict[tuple, int] = {}
    for a in agents:
        if _key(a) not in index:
            index[_key(a)] = len(pic.lanes)
            pic.lanes.append(a)
    seqs = sorted({tl["previous_seq"], tl["seq"], *(s["seq"] for s in tl["syncs"])})
    col = {q: i for i, q in enumerate(seqs)}
    pic.columns = len(seqs)
    p = (index[_key(prev["agent"])], col[tl["previous_seq"]])
    c = (index[_key(cur["agent"])], col[tl["seq"]])
    pic.steps.append(Step(p[0], p[1], action(prev), "earlier", prev["location"]))
    pic.steps.append(Step(c[0], c[1], action(cur), "later", cur["location"]))
    records: dict[int, tuple] = {}
    for s in tl["syncs"]:
        at = (index[_key(s["agent"])], col[s["seq"]])
        pic.steps.append(Step(at[0], at[1], _sync_label(s), s["type"], s.get("location") or ""))
        t = s["type"]
        if t == "event-record":
            records[s["event"]] = at
        elif t in ("event-wait", "event-sync") and s["event"] in records:
            pic.edges.append(Edge(records[s["event"]], at, False, f"event {s['event']}"))
        elif t == "stream-sync":
            pic.edges.append(Edge((index[_key(s["waits_for"])], at[1]), at, False, "synchronize"))
        elif t == "device-sync":
            pic.edges += [Edge((i, at[1]), at, False, "device sync") for i, a in enumerate(pic.lanes)
                          if a["kind"] == "stream" and a.get("device") == s["device"]]
    pic.edges.append(Edge(p, c, True, "missing edge"))
    return pic
