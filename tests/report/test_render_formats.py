"""SARIF (validated against the official SARIF 2.1.0 schema in tests/report/data), HTML (self-contained; the notebook
fragment), Perfetto trace events, and `streamsan show --format` for each."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent

from streamsan import events as E  # noqa: E402
from streamsan.cli import main  # noqa: E402
from streamsan.report.render_html import render_html, render_session_html  # noqa: E402
from streamsan.report.render_markdown import render_markdown  # noqa: E402
from streamsan.report.render_perfetto import render_perfetto  # noqa: E402
from streamsan.report.render_sarif import render_sarif  # noqa: E402
from streamsan.session import Session  # noqa: E402
from tests.support import render_screenshot  # noqa: E402
from tests.support import report_scenarios as S  # noqa: E402
from tests.support.report_kit import report_of  # noqa: E402

SARIF_SCHEMA = _HERE / "data" / "sarif-schema-2.1.0.json"


@pytest.fixture(scope="module")
def sample():
    """Every kind, one with a timeline, one (alloc-reuse) suppressed: the screenshot script's report."""
    return render_screenshot.sample_report()


def sarif_validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SARIF_SCHEMA.read_text())
    assert schema["id"] == "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema, format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER)


# ---------------------------------------------------------------- SARIF
def test_sarif_validates_against_the_official_schema(sample):
    v = sarif_validator()
    for log in (render_sarif(sample), render_sarif(sample, root="/home/u"), render_sarif(report_of(S.prologue()))):
        errors = [f"{list(e.path)}: {e.message}" for e in v.iter_errors(json.loads(json.dumps(log)))]
        assert errors == []


def test_sarif_result_of_a_finding():
    rep = report_of(S.pinned_d2h_then_h2d(3))
    log = render_sarif(rep, root="/home/u")
    assert log["version"] == "2.1.0" and log["$schema"].endswith("/sarif-schema-2.1.0.json")
    (run,) = log["runs"]
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == ["device-device", "host-device", "alloc-reuse",
                                                                 "missing-record-stream"]
    assert run["tool"]["driver"]["name"] == "streamsan" and run["originalUriBaseIds"] == {
        "SRCROOT": {"uri": "file:///home/u/"}}
    assert run["invocations"] == [{"executionSuccessful": True, "commandLine": "python run.py",
                                   "toolExecutionNotifications": []}]
    (res,) = run["results"]
    race = rep["races"][0]
    later = {"message": {"text": "later access: read aten::copy_ on prefetch_stream at u/proj/cache_utils.py:140"},
             "physicalLocation": {"artifactLocation": {"uri": "proj/cache_utils.py", "uriBaseId": "SRCROOT"},
                                  "region": {"startLine": 140}},
             "logicalLocations": [{"name": "prefetch", "kind": "function"}]}
    earlier = {"message": {"text": "earlier access: write aten::copy_ on the default stream at "
                                   "u/proj/cache_utils.py:120"},
               "physicalLocation": {"artifactLocation": {"uri": "proj/cache_utils.py", "uriBaseId": "SRCROOT"},
                                    "region": {"startLine": 120}},
               "logicalLocations": [{"name": "offload", "kind": "function"}]}
    assert res == {
        "ruleId": "device-device", "ruleIndex": 0, "level": "error",
        "message": {"text": f"{race['missing_edge']} Fix: {race['fix']}"},
        "locations": [later], "relatedLocations": [dict(earlier, id=1)],
        "codeFlows": [{"threadFlows": [{"locations": [{"location": earlier}, {"location": later}]}]}],
        "partialFingerprints": {"streamsanFingerprint/v1": race["fingerprint"]},
        "occurrenceCount": 3, "properties": {"memory": race["memory"]},
    }


def test_sarif_paths_outside_the_root_suppressions_and_notes(sample):
    log = render_sarif(sample, root="/elsewhere")
    results = log["runs"][0]["results"]
    assert [r["ruleId"] for r in results] == ["device-device", "device-device", "host-device",
                                              "missing-record-stream", "alloc-reuse"]
    assert results[0]["locations"][0]["physicalLocation"]["artifactLocation"] == {
        "uri": "file:///home/u/proj/cache_utils.py"}
    assert results[4]["suppressions"] == [{
        "kind": "external", "status": "accepted",
        "justification": "the side stream's fill is a known benign reuse in this sample (kind:alloc-reuse, "
                         "streamsan.supp:1)"}]
    assert all("suppressions" not in r for r in results[:4])
    rep = report_of(S.prologue() + [E.note("warning", "a CUDA graph was not analyzed")], complete=False,
                    problems=["t.sstrace: truncated frame"])
    assert render_sarif(rep)["runs"][0]["invocations"] == [{
        "executionSuccessful": False, "commandLine": "python run.py", "toolExecutionNotifications": [
            {"level": "warning", "message": {"text": "a CUDA graph was not analyzed"}},
            {"level": "warning", "message": {"text": "incomplete: t.sstrace: truncated frame"}}]}]


# ---------------------------------------------------------------- HTML
def test_html_is_one_self_contained_file(sample):
    html = render_html(sample)
    assert html.startswith('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                           "<title>streamsan: 4 CUDA stream races found</title><style>")
    assert re.findall(r"https?://[^\"' )]+", html) == ["http://www.w3.org/2000/svg"] * 4  # SVG namespaces only
    assert re.findall(r"<(script|link|img|iframe)\b", html) == []
    assert re.findall(r"url\(([^)]*)\)", html) == ["#ss-a1", "#ss-a1", "#ss-a1", "#ss-m1", "#ss-m2", "#ss-m3",
                                                   "#ss-m4"]
    assert html.count("<svg ") == 4 and html.count('<section class="finding"') == 4


def test_html_content(sample):
    html = render_html(sample)
    assert ('<tr><td class="n"><a href="#ss-f1">1</a></td><td>device-device</td><td>read aten::copy_ on '
            'prefetch_stream at <code>u/proj/cache_utils.py:140</code></td><td>write aten::fill_ on the default '
            'stream at <code>u/proj/cache_utils.py:160</code></td><td>bfloat16[1, 8, 2, 128]</td>'
            '<td class="n">1</td></tr>') in html
    assert ("<dt>Fix</dt><dd>Call <code>prefetch_stream.wait_stream(torch.cuda.current_stream())</code> before "
            "aten::copy_ at u/proj/cache_utils.py:140") in html
    assert ">synchronize()</text>" in html and ">event wait 1</text>" in html and ">missing edge</text>" in html
    assert html.count('stroke-dasharray="6 4"') == 4  # one missing edge per finding
    assert html.count("This report holds no sync events") == 0  # every sample finding has its timeline
    assert ("<h2>Suppressed (1)</h2><table><tr><th>Kind</th><th>Later access</th><th>Count</th><th>Rule</th>"
            "<th>Reason</th></tr><tr><td>alloc-reuse</td>") in html
    assert "<details><summary>Environment</summary><table><tr><th>streamsan</th><td><code>0.1.0</code>" in html


def test_html_escapes_everything():
    rep = report_of(S.alloc_reuse())
    rep["races"][0]["access"]["context"] = "<script>alert(1)</script>"
    rep["races"][0]["access"]["op"] = 'a"<b>'
    html = render_html(rep)
    assert "<script>" not in html and "<b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "a&quot;&lt;b&gt;" in html
    assert "This report holds no sync events for it (reports replayed from a trace do)." in html


def test_html_of_a_report_without_races():
    html = render_html(report_of(S.prologue(), complete=False, problems=["crashed"]))
    assert "<title>streamsan: no races found, but the report is incomplete</title>" in html and "<svg" not in html
    assert '<p class="warn">Incomplete: crashed</p>' in html


def test_session_html_fragment(sample, monkeypatch):
    frag = render_session_html(sample)
    assert frag.startswith('<div class="ss"><style>') and frag.endswith("</div>")
    assert frag.count("<svg ") == 4 and "<h2>1. device-device ×1</h2>" in frag
    assert "<p>1 suppressed finding not shown.</p>" in frag and "Environment" not in frag
    import streamsan.report.environment as env

    monkeypatch.setattr(env, "collect_environment", lambda import_missing=True: {})
    s = Session()
    s.start()
    try:
        s.buffer.events.extend(S.pinned_d2h_then_h2d())
        assert s._repr_html_() == render_session_html(s.report())
        assert "<h2>1. device-device ×1</h2>" in s._repr_html_()
    finally:
        s.stop()


@pytest.mark.skipif(render_screenshot.chromium() is None, reason="chromium is not installed")
def test_headless_chromium_renders_the_html(tmp_path, capsys):
    assert render_screenshot.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / "report.png"), str(tmp_path / "session.png")]
    for name in ("report.png", "session.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") == 1200


# ---------------------------------------------------------------- Perfetto
def test_perfetto_events_of_a_finding():
    rep = report_of(S.host_read_after_d2h())
    fp = rep["races"][0]["fingerprint"]
    assert render_perfetto(rep)["traceEvents"] == [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "1. host-device x1 on bfloat16[1, 8, 2, 128]"}},
        {"ph": "M", "pid": 1, "name": "process_sort_index", "args": {"sort_index": 1}},
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "default (0x0)"}},
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_sort_index", "args": {"sort_index": 0}},
        {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "host"}},
        {"ph": "M", "pid": 1, "tid": 2, "name": "thread_sort_index", "args": {"sort_index": 1}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 80, "name": "write aten::copy_", "cat": "streamsan.access",
         "args": {"role": "earlier", "location": "u/proj/cache_utils.py:120"}},
        {"ph": "i", "s": "t", "pid": 1, "tid": 1, "ts": 40, "name": "host-device", "cat": "streamsan.race",
         "args": {"access": "earlier", "fingerprint": fp}},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 100, "dur": 80, "name": "read aten::sum", "cat": "streamsan.access",
         "args": {"role": "later", "location": "u/proj/run.py:9"}},
        {"ph": "i", "s": "t", "pid": 1, "tid": 2, "ts": 140, "name": "host-device", "cat": "streamsan.race",
         "args": {"access": "later", "fingerprint": fp}},
        {"ph": "s", "id": 1, "pid": 1, "tid": 1, "ts": 1, "name": "missing edge", "cat": "streamsan.missing"},
        {"ph": "f", "bp": "e", "id": 1, "pid": 1, "tid": 2, "ts": 101, "name": "missing edge",
         "cat": "streamsan.missing"},
    ]


def test_perfetto_flows_start_and_end_inside_slices(sample):
    events = render_perfetto(sample)["traceEvents"]
    slices = [(e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X"]
    flows = [e for e in events if e["ph"] in "sf"]
    for f in flows:
        assert any(p == f["pid"] and t == f["tid"] and a <= f["ts"] < b for p, t, a, b in slices), f
    starts = sorted(e["id"] for e in flows if e["ph"] == "s")
    assert starts == sorted(e["id"] for e in flows if e["ph"] == "f") == list(range(1, len(starts) + 1))
    first = [e for e in events if e.get("pid") == 1]
    assert sorted({(e["cat"], e["name"]) for e in first if e["ph"] == "s"}) == [
        ("streamsan.missing", "missing edge"), ("streamsan.sync", "event 1"), ("streamsan.sync", "event 2"),
        ("streamsan.sync", "synchronize")]
    assert [e["name"] for e in first if e["ph"] == "X" and e["name"] == "synchronized"] == ["synchronized"]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["device-device"] * 4 + ["host-device"] * 2 + [
        "missing-record-stream"] * 2


# ---------------------------------------------------------------- streamsan show --format
@pytest.mark.parametrize("fmt,check", [
    ("sarif", lambda out: json.loads(out)["runs"][0]["results"][0]["ruleId"] == "device-device"),
    ("html", lambda out: out.startswith("<!DOCTYPE html>") and out.endswith("</html>\n")),
    ("perfetto", lambda out: json.loads(out)["traceEvents"][0]["name"] == "process_name"),
])
def test_show_formats(capsys, tmp_path, fmt, check):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report_of(S.pinned_d2h_then_h2d())))
    assert main(["show", str(path), "--format", fmt]) == 0
    assert check(capsys.readouterr().out)


def test_markdown_and_html_name_the_tests_a_finding_occurred_in():
    rep = report_of(S.pinned_d2h_then_h2d())
    rep["races"][0]["tests"] = ["tests/test_a.py::test_x", "tests/test_b.py::test_y"]
    assert "- **Tests:** `tests/test_a.py::test_x`, `tests/test_b.py::test_y`\n" in render_markdown(rep)
    assert ("<dt>Tests</dt><dd><code>tests/test_a.py::test_x</code>, <code>tests/test_b.py::test_y</code></dd>"
            in render_html(rep))
