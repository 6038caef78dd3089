"""HTML: a report that checked nothing or is incomplete never looks like a pass (headline, no green, its
warnings at the top, in the notebook view too), and a wide timeline keeps its size in a scrolling box."""

from __future__ import annotations

import re

from streamsan.report.render_html import render_html, render_session_html
from streamsan.report.render_svg import render_svg
from streamsan.report.timeline import picture
from streamsan.tracers.support import NO_CUDA
from tests.support import report_scenarios as S
from tests.support.report_kit import report_of


def unchecked_report() -> dict:
    rep = report_of(S.prologue())
    rep["notes"] = [{"level": "warning", "text": NO_CUDA}]
    return rep


def test_a_report_that_checked_nothing_is_no_green_pass():
    html = render_html(unchecked_report())
    assert "<title>streamsan: nothing was checked: no CUDA stream work was traced</title>" in html
    assert "<h1>streamsan: nothing was checked: no CUDA stream work was traced</h1>" in html
    assert "class=ok" not in html and "no races found</h1>" not in html
    assert f'<p class="warn">Warning: {NO_CUDA}</p>' in html
    assert "<li>warning:" not in html  # (said at the top, not as a plain bullet)


def test_nothing_checked_without_a_note_says_so_itself():
    html = render_html(report_of(S.prologue()))
    assert '<p class="warn">Nothing was checked: no CUDA stream work was traced.</p>' in html


def test_the_notebook_view_keeps_the_warnings():
    frag = render_session_html(unchecked_report())
    assert "<h2>streamsan: nothing was checked: no CUDA stream work was traced</h2>" in frag
    assert f'<p class="warn">Warning: {NO_CUDA}</p>' in frag and "class=ok" not in frag


def test_a_clean_checked_report_is_a_green_pass():
    html = render_html(report_of(S.host_read_after_d2h(synchronized=True)))
    assert "<h1>streamsan: no races found</h1>" in html and "<p class=ok>" in html and 'class="warn"' not in html


def test_a_wide_timeline_keeps_its_size_and_scrolls():
    rep = report_of(S.pinned_d2h_then_h2d())
    race = rep["races"][0]
    host = {"kind": "host", "stream": None, "device": None, "role": "host"}
    race["timeline"] = {"previous_seq": 0, "seq": 41, "omitted": 0, "syncs": [
        {"seq": i, "type": "stream-sync", "agent": host, "waits_for": race["previous_access"]["agent"],
         "location": f"run.py:{i}"} for i in range(1, 41)]}
    svg = render_svg(picture(race), "1")
    width = int(re.search(r'<svg [^>]*width="(\d+)"', svg).group(1))
    assert width > 2000 and "max-width" not in svg
    html = render_html(rep)
    assert ".ss .pic{overflow-x:auto;margin:8px 0 2px}.ss .pic svg{max-width:none}" in html
