"""Counts read right in the singular ("1 event", "1 occurrence", "merged 1 report"), and Markdown escapes the
fix and the missing edge as it escapes every other text, keeping their code spans."""

from __future__ import annotations

from streamsan.report.render_markdown import render_markdown
from streamsan.report.render_text import count_text, totals_text
from tests.support import report_scenarios as S
from tests.support.report_kit import report_of
from tests.support.wrap_kit import run


def summary(**counts) -> dict:
    s = {"races": 0, "occurrences": 0, "by_kind": {}, "events": 0, "ops": 0, "streams": 0}
    s.update(counts)
    return {"summary": s}


def test_count_text():
    assert [count_text(n, "event") for n in (0, 1, 2)] == ["0 events", "1 event", "2 events"]


def test_totals_in_the_singular_and_plural():
    assert totals_text(summary(events=1, ops=1, streams=1)) == (
        "streamsan: no races found (1 event, 1 stream op, 1 stream).")
    one = summary(races=1, occurrences=1, by_kind={"device-device": 1}, events=1, ops=1, streams=1)
    assert totals_text(one) == ("streamsan: 1 race found, 1 occurrence (1 device-device; 1 event, 1 stream op, "
                                "1 stream).")
    two = summary(races=2, occurrences=3, by_kind={"device-device": 2}, events=5, ops=2, streams=2)
    assert totals_text(two) == ("streamsan: 2 races found, 3 occurrences (2 device-device; 5 events, 2 stream ops, "
                                "2 streams).")


def test_merge_of_one_report(capfd, tmp_path):
    r = tmp_path / "r.json"
    r.write_text(__import__("json").dumps(report_of(S.pinned_d2h_then_h2d())))
    code, _, err = run(capfd, "merge", r, "-o", tmp_path / "m.json")
    assert code == 0 and err == f"streamsan: merged 1 report (1 race) into {tmp_path / 'm.json'}\n"


def test_markdown_escapes_the_fix_and_the_missing_edge_but_not_their_code():
    rep = report_of(S.pinned_d2h_then_h2d())
    race = rep["races"][0]
    race["fix"] = "Call `<stream 0x5>.wait_stream(a)` before op<T> at run.py:3 & then <b>go</b>."
    race["missing_edge"] = "x<y> on `s<1>`."
    md = render_markdown(rep)
    assert "- **Fix:** Call `<stream 0x5>.wait_stream(a)` before op&lt;T&gt; at run.py:3 &amp; then " \
           "&lt;b&gt;go&lt;/b&gt;." in md
    assert "- **Missing edge:** x&lt;y&gt; on `s<1>`." in md
