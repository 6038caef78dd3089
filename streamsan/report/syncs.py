"""The synchronization around each finding: the optional ``timeline`` of a race item, from which renderers
draw the sync edges that exist between its two accesses.

The analyzer keeps no event log, so this is a second pass over the same events (a trace's batches), after
the analysis. For each finding it keeps the sync events strictly between the earlier and the later access
that involve one of the two agents (or the host): event records and waits, stream, event and device
synchronizations, and the free of the memory's earlier life; at most :data:`LIMIT`, nearest to the later
access. The record of a kept wait or event sync is kept too, even from before the earlier access (an event
recorded too early).
"""

from __future__ import annotations

from .. import events as E
from ..events import HOST
from ..analysis.locations import location
from .build import agent_item

LIMIT = 12
_TYPES = {E.EVENT_RECORD: "event-record", E.EVENT_WAIT: "event-wait", E.STREAM_SYNC: "stream-sync",
          E.EVENT_SYNC: "event-sync", E.DEVICE_SYNC: "device-sync", E.FREE: "free"}


class _Window:
    """One finding's interval of events and what was found in it: (seq, kind, agent, event, device, stack,
    seq of the record a wait or event sync joins)."""

    def __init__(self, analyzer, f):
        self.fingerprint = f.fingerprint
        self.lo, self.hi = f.previous.seq, f.current.seq
        self.agents = {f.previous.agent, f.current.agent}
        self.devices = {analyzer.agents[a].device for a in self.agents if a != HOST and a in analyzer.agents}
        old = f.prev_block
        self.free = (old.space, old.start) if old is not None else None
        self.items: dict[int, tuple] = {}

    def consider(self, seq: int, ev, records: dict) -> None:
        k = ev[0]
        rec = records.get(ev[1]) if k in (E.EVENT_WAIT, E.EVENT_SYNC) else None
        if k == E.EVENT_RECORD:
            keep, item = ev[2] in self.agents, (seq, k, ev[2], ev[1], None, ev[3], None)
        elif k == E.EVENT_WAIT:
            keep, item = ev[2] in self.agents, (seq, k, ev[2], ev[1], None, ev[3], rec and rec[0])
        elif k == E.STREAM_SYNC:
            keep, item = ev[1] in self.agents, (seq, k, ev[1], None, None, ev[2], None)
        elif k == E.EVENT_SYNC:
            keep, item = rec is not None and rec[1] in self.agents, (seq, k, HOST, ev[1], None, ev[2], rec and rec[0])
        elif k == E.DEVICE_SYNC:
            keep, item = ev[1] in self.devices, (seq, k, HOST, None, ev[1], ev[2], None)
        else:  # FREE
            keep, item = (ev[1], ev[2]) == self.free, (seq, k, HOST, None, None, ev[3], None)
        if not keep:
            return
        self.items[seq] = item
        if rec is not None:
            self.items.setdefault(rec[0], (rec[0], E.EVENT_RECORD, rec[1], ev[1], None, rec[2], None))

    def timeline(self, analyzer) -> dict:
        items = sorted(self.items.values())
        kept = items[-LIMIT:]
        needed = {i[6] for i in kept}
        kept = [i for i in items[:-LIMIT] if i[0] in needed] + kept
        return {"previous_seq": self.lo, "seq": self.hi, "syncs": [_item(analyzer, i) for i in kept],
                "omitted": len(items) - len(kept)}


def _item(analyzer, i: tuple) -> dict:
    seq, k, agent, event, device, stack, _ = i
    out = {"seq": seq, "type": _TYPES[k]}
    if k == E.STREAM_SYNC:
        out["agent"], out["waits_for"] = agent_item(analyzer, HOST), agent_item(analyzer, agent)
    else:
        out["agent"] = agent_item(analyzer, agent)
    if event is not None:
        out["event"] = event
    if device is not None:
        out["device"] = device
    out["location"] = location(analyzer.stacks.get(stack, ()), "") or None
    return out


def collect_timelines(batches, analyzer) -> dict:
    """``{fingerprint: timeline}`` for the analyzer's findings, from the batches it was fed (again)."""
    windows = sorted((_Window(analyzer, f) for f in analyzer.findings.values()), key=lambda w: w.lo)
    if not windows:
        return {}
    end = max(w.hi for w in windows)
    records: dict[int, tuple] = {}
    active: list = []  # the windows open at seq
    started = 0
    seq = 0
    for batch in batches:
        for ev in batch:
            k = ev[0]
            if k in _TYPES:
                while started < len(windows) and windows[started].lo < seq:
                    active.append(windows[started])
                    started += 1
                active = [w for w in active if seq < w.hi]
                for w in active:
                    w.consider(seq, ev, records)
                if k == E.EVENT_RECORD:
                    records[ev[1]] = (seq, ev[2], ev[3])
            seq += 1
        if seq > end:
            break
    return {w.fingerprint: w.timeline(analyzer) for w in windows}


def attach_timelines(report: dict, timelines: dict) -> None:
    """Give each race item of the report its timeline, where there is one."""
    for race in report["races"]:
        t = timelines.get(race["fingerprint"])
        if t is not None:
            race["timeline"] = t
