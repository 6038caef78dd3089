"""The optional ``timeline`` of a race item (the syncs between its two accesses, read back from the trace) and
the picture that the HTML and Perfetto renderers draw from a race item."""

from __future__ import annotations

import json

from streamsan import events as E
from streamsan.replay import replay_trace
from streamsan.report.syncs import LIMIT, collect_timelines
from streamsan.report.timeline import Edge, Step, lane_label, picture
from tests.support import report_scenarios as S
from tests.support.report_kit import report_of, validator
from tests.support.report_kit import write_trace

DEFAULT = {"kind": "stream", "stream": "0x0", "device": 0, "role": "default"}
PREFETCH = {"kind": "stream", "stream": hex(S.PREFETCH_HANDLE), "device": 0, "role": "prefetch_stream"}
SIDE = {"kind": "stream", "stream": hex(S.SIDE_HANDLE), "device": 0, "role": None}
HOST = {"kind": "host", "stream": None, "device": None, "role": "host"}


def timeline_of(events):
    a = S.analyze(events)
    (t,) = collect_timelines([events], a).values()
    return t


def test_recorded_too_early_keeps_the_early_record_and_the_relevant_syncs():
    t = timeline_of(S.recorded_too_early())
    n = len(S.prologue())
    assert (t["previous_seq"], t["seq"], t["omitted"]) == (n + 2, n + 8, 0)
    assert t["syncs"] == [
        {"seq": n + 1, "type": "event-record", "agent": DEFAULT, "event": 1, "location": "u/proj/run.py:9"},
        {"seq": n + 3, "type": "event-record", "agent": PREFETCH, "event": 2, "location": None},
        {"seq": n + 4, "type": "event-wait", "agent": DEFAULT, "event": 2, "location": None},
        # n + 5, the host's sync with the side stream, involves neither access's stream
        {"seq": n + 6, "type": "stream-sync", "agent": HOST, "waits_for": PREFETCH, "location": "u/proj/run.py:11"},
        {"seq": n + 7, "type": "event-wait", "agent": PREFETCH, "event": 1,
         "location": "u/proj/cache_utils.py:138"},
    ]


def test_frees_of_the_earlier_life_and_the_limit():
    assert timeline_of(S.alloc_reuse())["syncs"] == [
        {"seq": len(S.prologue()) + 2, "type": "free", "agent": HOST, "location": None}]
    events = S.prologue() + [
        E.op(S.DEFAULT, "aten::fill_", writes=[(0, 0xA000, 64)], stack=3),
        E.event_record(7, S.PREFETCH),
        *[E.stream_sync(S.PREFETCH) for _ in range(15)],
        E.event_wait(7, S.DEFAULT),
        E.op(S.PREFETCH, "aten::copy_", reads=[(0, 0xA000, 64)], writes=[(0, 0xC000, 64)], stack=2),
    ]
    t = timeline_of(events)
    n = len(S.prologue())
    assert [(s["seq"] - n, s["type"]) for s in t["syncs"]] == (
        [(1, "event-record")] + [(i, "stream-sync") for i in range(6, 17)] + [(17, "event-wait")])
    assert len(t["syncs"]) == LIMIT + 1 and t["omitted"] == 4


def test_replay_attaches_timelines_and_they_validate(tmp_path):
    trace = write_trace(tmp_path / "t.sstrace", [S.recorded_too_early()[:20], S.recorded_too_early()[20:]])
    rep = replay_trace(str(trace))
    assert rep["races"][0]["timeline"] == timeline_of(S.recorded_too_early())
    validator().validate(json.loads(json.dumps(rep)))


# ---------------------------------------------------------------- the picture
def test_picture_without_timeline_is_the_two_accesses_and_the_missing_edge():
    (race,) = report_of(S.host_read_after_d2h())["races"]
    pic = picture(race)
    assert pic.lanes == [DEFAULT, HOST] and pic.columns == 2
    assert pic.steps == [Step(0, 0, "write aten::copy_", "earlier", "u/proj/cache_utils.py:120"),
                         Step(1, 1, "read aten::sum", "later", "u/proj/run.py:9")]
    assert pic.edges == [Edge((0, 0), (1, 1), True, "missing edge")]


def test_picture_of_a_timeline():
    (race,) = report_of(S.recorded_too_early())["races"]
    race["timeline"] = timeline_of(S.recorded_too_early())
    pic = picture(race)
    assert [lane_label(a) for a in pic.lanes] == ["default (0x0)", f"prefetch_stream ({hex(S.PREFETCH_HANDLE)})",
                                                  "host"]
    assert pic.columns == 7
    assert [(s.lane, s.x, s.label, s.role) for s in pic.steps] == [
        (0, 1, "write aten::fill_", "earlier"), (1, 6, "read aten::copy_", "later"),
        (0, 0, "event record 1", "event-record"), (1, 2, "event record 2", "event-record"),
        (0, 3, "event wait 2", "event-wait"), (2, 4, "synchronize()", "stream-sync"),
        (1, 5, "event wait 1", "event-wait")]
    assert pic.edges == [Edge((1, 2), (0, 3), False, "event 2"), Edge((1, 4), (2, 4), False, "synchronize"),
                         Edge((0, 0), (1, 5), False, "event 1"), Edge((0, 1), (1, 6), True, "missing edge")]


def test_picture_of_event_and_device_syncs_and_a_third_stream():
    (race,) = report_of(S.pinned_d2h_then_h2d())["races"]
    race["timeline"] = {"previous_seq": 10, "seq": 15, "omitted": 0, "syncs": [
        {"seq": 11, "type": "event-record", "agent": SIDE, "event": 4, "location": None},
        {"seq": 12, "type": "event-sync", "agent": HOST, "event": 4, "location": None},
        {"seq": 13, "type": "device-sync", "agent": HOST, "device": 0, "location": "run.py:3"},
        {"seq": 14, "type": "free", "agent": HOST, "location": None}]}
    pic = picture(race)
    assert [lane_label(a) for a in pic.lanes] == ["default (0x0)", f"prefetch_stream ({hex(S.PREFETCH_HANDLE)})",
                                                  f"stream {hex(S.SIDE_HANDLE)}", "host"]
    assert [(s.lane, s.x, s.label) for s in pic.steps[2:]] == [
        (2, 1, "event record 4"), (3, 2, "event sync 4"), (3, 3, "device sync cuda:0"), (3, 4, "free (old life)")]
    assert pic.edges == [Edge((2, 1), (3, 2), False, "event 4"), Edge((0, 3), (3, 3), False, "device sync"),
                         Edge((1, 3), (3, 3), False, "device sync"), Edge((2, 3), (3, 3), False, "device sync"),
                         Edge((0, 0), (1, 5), True, "missing edge")]
