"""``--fail-on-race`` is a CI gate: without races it passes only a complete report in which something was
checked. An incomplete report exits 67, one where no CUDA stream work was traced 68 (each with one line
saying why); ``--allow-incomplete`` passes both; races still exit 66."""

from __future__ import annotations

import json
import os
import sys

import pytest

from streamsan import exitcodes
from streamsan.trace import TraceWriter
from tests.support import report_scenarios as S
from tests.support.wrap_kit import child, run  # noqa: F401

INCOMPLETE_LINE = ("streamsan: --fail-on-race: no race found, but the report is incomplete (exit 67; "
                   "--allow-incomplete passes it)")
UNCHECKED_LINE = ("streamsan: --fail-on-race: no race found, but nothing was checked: no CUDA stream work was "
                  "traced (exit 68; --allow-incomplete passes it)")


def trace(path, events, close=True):
    w = TraceWriter(str(path), {"command": ["python", "run.py"]})
    w.write(events)
    if close:
        w.close()
    else:
        os.close(w.fd)
    return path


def test_the_exit_codes():
    assert (exitcodes.RACES, exitcodes.INCOMPLETE, exitcodes.NOTHING_CHECKED) == (66, 67, 68)


def test_a_truncated_trace_fails_the_gate(capfd, tmp_path):
    t = trace(tmp_path / "t.sstrace", S.host_read_after_d2h(synchronized=True), close=False)
    code, out, err = run(capfd, "replay", t, "--fail-on-race")
    assert code == exitcodes.INCOMPLETE and "the report is incomplete" in out
    assert err == INCOMPLETE_LINE + "\n"
    assert run(capfd, "replay", t, "--fail-on-race", "--allow-incomplete")[0] == exitcodes.OK
    assert run(capfd, "replay", t)[0] == exitcodes.OK  # (without the gate, as before)


def test_a_flipped_byte_fails_the_gate(capfd, tmp_path):
    t = trace(tmp_path / "t.sstrace", S.host_read_after_d2h(synchronized=True))
    data = bytearray(t.read_bytes())
    data[-20] ^= 0xFF  # in the end frame
    t.write_bytes(bytes(data))
    assert run(capfd, "replay", t, "--fail-on-race")[0] == exitcodes.INCOMPLETE


def test_a_trace_where_nothing_was_checked_fails_the_gate(capfd, tmp_path, monkeypatch):
    t = trace(tmp_path / "t.sstrace", S.prologue())
    code, _, err = run(capfd, "replay", t, "--fail-on-race")
    assert (code, err) == (exitcodes.NOTHING_CHECKED, UNCHECKED_LINE + "\n")
    monkeypatch.setenv("STREAMSAN_ALLOW_INCOMPLETE", "1")
    assert run(capfd, "replay", t, "--fail-on-race")[0] == exitcodes.OK


def test_races_beat_the_gate(capfd, tmp_path):
    t = trace(tmp_path / "t.sstrace", S.pinned_d2h_then_h2d(), close=False)
    assert run(capfd, "replay", t, "--fail-on-race")[0] == exitcodes.RACES


def test_a_complete_checked_report_passes(capfd, tmp_path):
    t = trace(tmp_path / "t.sstrace", S.host_read_after_d2h(synchronized=True))
    assert run(capfd, "replay", t, "--fail-on-race") == (exitcodes.OK, run(capfd, "replay", t)[1], "")


def test_show_and_merge_gate_alike(capfd, tmp_path):
    t = trace(tmp_path / "t.sstrace", S.prologue())
    r = tmp_path / "r.json"
    assert run(capfd, "replay", t, "--report", r)[0] == 0
    assert run(capfd, "show", r, "--fail-on-race")[0] == exitcodes.NOTHING_CHECKED
    assert run(capfd, "merge", r, "-o", tmp_path / "m.json", "--fail-on-race")[0] == exitcodes.NOTHING_CHECKED


def test_wrap_of_a_program_that_checked_nothing(capfd, child, tmp_path):
    code, _, err = run(capfd, "wrap", "--fail-on-race", "--", sys.executable, "-c", "print('cpu only')")
    assert code == exitcodes.NOTHING_CHECKED, err
    assert err.splitlines()[-1] == UNCHECKED_LINE
    assert run(capfd, "wrap", "--fail-on-race", "--allow-incomplete", "--", sys.executable, "-c", "pass")[0] == 0


def test_wrap_of_a_program_that_wrote_no_trace_is_incomplete(capfd, child):
    assert run(capfd, "wrap", "--fail-on-race", "--", "true")[0] == exitcodes.INCOMPLETE


def test_wrap_keeps_the_programs_failure_over_the_gate(capfd, child, tmp_path):
    code, _, _ = run(capfd, "wrap", "--fail-on-race", "--", *child, "kill", 0)
    assert code == exitcodes.RACES  # (its trace has a race: races first, as before)
    code, _, err = run(capfd, "wrap", "--fail-on-race", "--", "false")
    assert code == 1 and "--fail-on-race" not in err
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert rep["complete"] is False


@pytest.mark.parametrize("table", ["allow_incomplete = true"])
def test_allow_incomplete_in_pyproject(capfd, tmp_path, monkeypatch, table):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text(f"[tool.streamsan]\n{table}\n")
    t = trace(tmp_path / "t.sstrace", S.prologue())
    assert run(capfd, "replay", t, "--fail-on-race")[0] == exitcodes.OK
    assert run(capfd, "replay", t, "--fail-on-race", "--no-allow-incomplete")[0] == exitcodes.NOTHING_CHECKED
