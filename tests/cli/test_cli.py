"""``streamsan replay / show / merge``: happy paths and every user error (one line, exit 2, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from streamsan import events as E
from streamsan import exitcodes
from streamsan.cli import main
from tests.support import report_scenarios as S
from tests.support.paths import ROOT
from tests.support.report_kit import write_trace


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(code, err, expected_code=exitcodes.USAGE, *fragments):
    assert code == expected_code, err
    assert err.startswith("streamsan: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err


@pytest.fixture
def trace(tmp_path):
    return write_trace(tmp_path / "t.sstrace", [S.pinned_d2h_then_h2d(3)])


# ---------------------------------------------------------------- replay
def test_replay_text(capsys, trace):
    code, out, err = run(capsys, "replay", trace)
    assert code == 0 and err == ""
    assert out.startswith("streamsan: 1 race found, 3 occurrences")
    assert "prefetch_stream.wait_stream(torch.cuda.current_stream())" in out


def test_replay_writes_the_report_and_fails_on_race(capsys, trace, tmp_path):
    out_path = tmp_path / "r.json"
    code, out, err = run(capsys, "replay", trace, "--report", out_path, "--format", "json", "--fail-on-race")
    assert code == exitcodes.RACES
    assert f"report written to {out_path}" in err
    rep = json.loads(out_path.read_text())
    assert json.loads(out) == rep
    assert rep["complete"] is True and rep["command"] == ["python", "run.py"] and rep["races"][0]["count"] == 3


def test_replay_without_races_under_fail_on_race(capsys, tmp_path):
    t = write_trace(tmp_path / "t.sstrace", [S.host_read_after_d2h(synchronized=True)])
    code, out, _ = run(capsys, "replay", t, "--fail-on-race")
    assert code == 0 and "no races found" in out


def test_replay_markdown(capsys, trace):
    code, out, _ = run(capsys, "replay", trace, "--format", "markdown")
    assert code == 0 and out.startswith("## streamsan: 1 CUDA stream race found")


def test_replay_of_several_traces_merges_them(capsys, tmp_path):
    a = write_trace(tmp_path / "a.sstrace", [S.pinned_d2h_then_h2d(2)])
    b = write_trace(tmp_path / "b.sstrace", [S.pinned_d2h_then_h2d(3)])
    code, out, _ = run(capsys, "replay", a, b, "--format", "json")
    rep = json.loads(out)
    assert code == 0 and rep["races"][0]["count"] == 5 and len(rep["processes"]) == 2


def test_replay_of_a_truncated_trace_reports_what_it_read(capsys, tmp_path):
    events = S.pinned_d2h_then_h2d()
    ends = []
    t = write_trace(tmp_path / "t.sstrace", [events, S.host_read_after_d2h()[len(S.prologue()):]], ends=ends)
    first_end, second_end = ends
    t.write_bytes(t.read_bytes()[:(first_end + second_end) // 2])  # in the middle of the second batch
    code, out, err = run(capsys, "replay", t, "--format", "json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["complete"] is False
    assert len(rep["problems"]) == 1 and "truncated" in rep["problems"][0]
    assert [r["kind"] for r in rep["races"]] == ["device-device"]
    assert rep["summary"]["events"] == len(events)
    code, out, _ = run(capsys, "replay", t)
    assert "the report is incomplete" in out


def test_replay_of_a_trace_without_end_mark(capsys, tmp_path):
    t = write_trace(tmp_path / "t.sstrace", [S.pinned_d2h_then_h2d()], close=False)
    code, out, _ = run(capsys, "replay", t, "--format", "json")
    rep = json.loads(out)
    assert code == 0 and rep["complete"] is False and "no end mark" in rep["problems"][0]
    assert len(rep["races"]) == 1


def test_replay_of_a_damaged_frame_keeps_earlier_events(capsys, tmp_path):
    ends = []
    t = write_trace(tmp_path / "t.sstrace", [S.pinned_d2h_then_h2d(), S.host_read_after_d2h()], ends=ends)
    first_end, second_end = ends
    data = bytearray(t.read_bytes())
    data[(first_end + second_end) // 2] ^= 0xFF  # inside the second batch's payload
    t.write_bytes(bytes(data))
    code, out, _ = run(capsys, "replay", t, "--format", "json")
    rep = json.loads(out)
    assert code == 0 and rep["complete"] is False and len(rep["races"]) == 1


# ---------------------------------------------------------------- replay errors
def test_replay_missing_file(capsys, tmp_path):
    assert_one_error(*run(capsys, "replay", tmp_path / "nope.sstrace")[::2], exitcodes.USAGE, "no such trace file")


def test_replay_directory(capsys, tmp_path):
    assert_one_error(*run(capsys, "replay", tmp_path)[::2], exitcodes.USAGE, "is a directory")


@pytest.mark.parametrize("content,fragment", [
    (b"", "not a streamsan trace"),
    (b"hello world, not a trace at all", "not a streamsan trace"),
    (b'{"schema": "streamsan.report/1"}', "not a streamsan trace"),
    (b"SSTRACE2" + b"\0" * 20, "trace format '2' is not supported"),
    (b"SSTRACE1", "trace header is missing or damaged"),
    (b"SSTRACE1\x05\0\0\0\0\0\0\0H", "trace header is missing or damaged"),
])
def test_replay_not_a_trace(capsys, tmp_path, content, fragment):
    p = tmp_path / "x.sstrace"
    p.write_bytes(content)
    assert_one_error(*run(capsys, "replay", p)[::2], exitcodes.USAGE, fragment)


def test_replay_wrong_trace_format_version_in_header(capsys, tmp_path):
    t = write_trace(tmp_path / "t.sstrace", [], header={"format": "streamsan.trace/9"})
    assert_one_error(*run(capsys, "replay", t)[::2], exitcodes.USAGE, "'streamsan.trace/9' is not supported")


@pytest.mark.parametrize("batch,fragment", [
    ([[99, 1]], "invalid event 0: unknown event kind 99"),
    ([("x",)], "invalid event 0: an event is an array"),
    ([E.stream(1, 0, 0, 0, "default"), (E.OP, 1, "aten::add_")], "invalid event 1: OP has 8 fields, got 3"),
    ([E.op(-5, "aten::add_", writes=[(0, 0, 4)])], "invalid event 0: OP: agent ids are integers"),
])
def test_replay_garbage_events(capsys, tmp_path, batch, fragment):
    t = write_trace(tmp_path / "t.sstrace", [batch])
    assert_one_error(*run(capsys, "replay", t)[::2], exitcodes.USAGE, fragment)


def test_replay_unwritable_report_fails_before_replaying(capsys, trace, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_error(*run(capsys, "replay", trace, "--report", blocker / "r.json")[::2], exitcodes.USAGE,
                     f"{blocker} is not a directory")
    assert_one_error(*run(capsys, "replay", trace, "--report", tmp_path)[::2], exitcodes.USAGE, "is a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes everything")
def test_replay_unreadable_trace_and_unwritable_directory(capsys, trace, tmp_path):
    trace.chmod(0)
    assert_one_error(*run(capsys, "replay", trace)[::2], exitcodes.USAGE, "cannot read")
    trace.chmod(0o644)
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    assert_one_error(*run(capsys, "replay", trace, "--report", d / "r.json")[::2], exitcodes.USAGE,
                     "permission denied")


# ---------------------------------------------------------------- show / merge
@pytest.fixture
def report_file(capsys, trace, tmp_path):
    path = tmp_path / "r.json"
    assert run(capsys, "replay", trace, "--report", path)[0] == 0
    return path


@pytest.mark.parametrize("fmt,start", [("text", "streamsan: 1 race"), ("markdown", "## streamsan"),
                                       ("json", "{")])
def test_show(capsys, report_file, fmt, start):
    code, out, _ = run(capsys, "show", report_file, "--format", fmt)
    assert code == 0 and out.startswith(start)


def test_show_fail_on_race(capsys, report_file):
    assert run(capsys, "show", report_file, "--fail-on-race")[0] == exitcodes.RACES


@pytest.mark.parametrize("content,fragment", [
    ("not json", "not a streamsan report (not JSON)"),
    ("[1, 2]", "not a streamsan report"),
    ('{"races": []}', "not a streamsan report"),
    ('{"schema": "streamsan.report/2", "races": []}', "report schema 'streamsan.report/2' is not supported"),
    ('{"schema": "streamsan.report/1", "races": []}', "malformed report (missing command, environment, summary)"),
    ('{"schema": "streamsan.report/1", "command": [], "environment": {}, "summary": {}, "races": {}}',
     "malformed report"),
])
def test_show_bad_reports(capsys, tmp_path, content, fragment):
    p = tmp_path / "r.json"
    p.write_text(content)
    assert_one_error(*run(capsys, "show", p)[::2], exitcodes.USAGE, fragment)


def test_show_report_with_malformed_races(capsys, report_file):
    rep = json.loads(report_file.read_text())
    del rep["races"][0]["access"]
    report_file.write_text(json.dumps(rep))
    assert_one_error(*run(capsys, "show", report_file)[::2], exitcodes.USAGE, "malformed report")


def test_show_missing_and_binary_files(capsys, tmp_path):
    assert_one_error(*run(capsys, "show", tmp_path / "nope.json")[::2], exitcodes.USAGE, "no such report file")
    p = tmp_path / "b.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_error(*run(capsys, "show", p)[::2], exitcodes.USAGE, "not JSON")


def test_merge(capsys, tmp_path):
    paths = []
    for i, n in enumerate((2, 3)):
        t = write_trace(tmp_path / f"t{i}.sstrace", [S.pinned_d2h_then_h2d(n)])
        paths.append(tmp_path / f"r{i}.json")
        assert run(capsys, "replay", t, "--report", paths[-1])[0] == 0
    out = tmp_path / "merged.json"
    code, _, err = run(capsys, "merge", *paths, "-o", out)
    assert code == 0 and f"merged 2 reports (1 race) into {out}" in err
    merged = json.loads(out.read_text())
    assert len(merged["races"]) == 1 and merged["races"][0]["count"] == 5 and len(merged["processes"]) == 2
    assert run(capsys, "merge", *paths, "-o", out, "--fail-on-race")[0] == exitcodes.RACES


def test_merge_errors(capsys, report_file, tmp_path):
    assert_one_error(*run(capsys, "merge", report_file)[::2], exitcodes.USAGE, "-o/--output")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "other"}')
    assert_one_error(*run(capsys, "merge", report_file, bad, "-o", tmp_path / "m.json")[::2], exitcodes.USAGE,
                     "report schema 'other' is not supported")
    assert_one_error(*run(capsys, "merge", report_file, "-o", report_file / "m.json")[::2],
                     exitcodes.USAGE, f"{report_file} is not a directory")


# ---------------------------------------------------------------- usage
@pytest.mark.parametrize("argv,fragment", [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["replay"], "required: TRACE"),
    (["replay", "t.sstrace", "--bogus"], "unrecognized arguments: --bogus"),
    (["replay", "t.sstrace", "--format", "xml"], "invalid choice: 'xml'"),
    (["show"], "required: REPORT"),
    (["wrap", "--scope", "partial", "--", "python"], "invalid choice: 'partial'"),
    (["wrap", "--report"], "expected one argument"),
])
def test_usage_errors_are_one_line(capsys, argv, fragment):
    assert_one_error(*run(capsys, *argv)[::2], exitcodes.USAGE, fragment)


def test_help_lists_the_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for line in ("66    races were found and --fail-on-race was given", "127   wrap: the command was not found",
                 "128+N wrap: the command was killed by signal N"):
        assert line in out


def test_python_dash_m_streamsan(tmp_path):
    p = subprocess.run([sys.executable, "-m", "streamsan", "replay", str(tmp_path / "nope")],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == exitcodes.USAGE
    assert p.stderr == f"streamsan: error: {tmp_path / 'nope'}: no such trace file\n"
