"""A report that cannot be written costs one line, never the findings: wrap still prints its summary, warns
once and keeps the command's exit code; replay prints its output first, then one error line. Missing
directories above an output are created (the documented ``report = "build/r.json"``); an empty path is an
error, not silence."""

from __future__ import annotations

import json

from streamsan import exitcodes
from streamsan.trace import TraceWriter
from tests.support import report_scenarios as S
from tests.support.wrap_kit import child, run  # noqa: F401

FULL = "/dev/full"


def test_wrap_with_an_unwritable_report_prints_the_summary_warns_once_and_keeps_the_exit_code(capfd, child):
    code, out, err = run(capfd, "wrap", "--report", FULL, "--", *child, "race", 3)
    assert code == 3
    assert err.startswith("streamsan: 1 race found, 2 occurrences (1 device-device; ")
    assert err.splitlines()[-1] == f"streamsan: warning: cannot write {FULL}: No space left on device"
    assert err.count(FULL) == 1 and "report written" not in err and out == ""


def test_replay_prints_its_output_then_one_error_line(capfd, tmp_path):
    t = tmp_path / "t.sstrace"
    w = TraceWriter(str(t), {"command": ["python", "run.py"]})
    w.write(S.pinned_d2h_then_h2d(2))
    w.close()
    code, out, err = run(capfd, "replay", t, "--report", FULL)
    assert code == exitcodes.USAGE
    assert out.startswith("streamsan: 1 race found, 2 occurrences")
    assert err == f"streamsan: error: cannot write {FULL}: No space left on device\n"


def test_the_directories_above_an_output_are_created(capfd, child, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.streamsan]\nreport = "build/r.json"\n')
    code, _, err = run(capfd, "wrap", "--trace", "out/traces/t.sstrace", "--", *child, "race", 0)
    assert code == 0, err
    assert json.loads((tmp_path / "build" / "r.json").read_text())["races"]
    assert (tmp_path / "out" / "traces" / "t.sstrace").is_file()
    assert f"streamsan: report written to {tmp_path / 'build' / 'r.json'}" in err


def test_an_empty_report_path_is_an_error(capfd, child, tmp_path):
    code, out, err = run(capfd, "wrap", "--report", "", "--", *child, "race", 0)
    assert (code, out, err) == (exitcodes.USAGE, "", "streamsan: error: an output path is empty (give a file name)\n")
    assert not (tmp_path / "seen.json").exists()  # the command never ran
