"""Long runs: the live status line on a terminal's stderr (a fake TTY here) and the ``streamsan`` logger's
diagnostics under ``streamsan -v``; the library itself prints nothing."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from streamsan.cli import main
from streamsan.replay import replay_trace
from streamsan.status import StatusLine, analysis_text
from tests.support import report_scenarios as S
from tests.support.report_kit import write_trace
from tests.support.wrap_kit import child  # noqa: F401  (fixture)


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_status_line_rewrites_in_place_throttles_cuts_and_clears():
    tty, clock = FakeTTY(), Clock()
    s = StatusLine(tty, interval=0.5, columns=30, clock=clock)
    s.update("streamsan: 10 events")
    clock.now = 0.2
    s.update("streamsan: 20 events")  # too soon: skipped
    clock.now = 0.6
    s.update("streamsan: 30 ev")  # shorter: padded over the old text
    clock.now = 1.2
    s.update("streamsan: a line much longer than the terminal")
    s.clear()
    assert tty.getvalue() == ("\rstreamsan: 10 events"
                              + "\rstreamsan: 30 ev" + " " * 4
                              + "\rstreamsan: a line much longer"
                              + "\r" + " " * 29 + "\r")


def test_status_line_is_silent_off_a_terminal():
    out = io.StringIO()
    s = StatusLine(out, interval=0)
    s.update("streamsan: 10 events")
    s.clear()
    assert out.getvalue() == "" and s.enabled is False


def test_analysis_text():
    assert analysis_text("trace-12.sstrace", 1, 3, 1234567, 2) == (
        "streamsan: analyzing trace-12.sstrace (1/3): 1,234,567 events, 2 findings so far")
    assert analysis_text("t.sstrace", 1, 1, 20, 1) == "streamsan: analyzing t.sstrace: 20 events, 1 finding so far"


def test_wrap_shows_the_status_line_on_a_tty_and_clears_it(child, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["wrap", "--", *child, "race", "0"]) == 0
    err = tty.getvalue()
    line = f"streamsan: analyzing trace-(\\d+).sstrace: {len(S.pinned_d2h_then_h2d(2))} events, 1 finding so far"
    m = re.match(f"\\r{line}\\r( +)\\rstreamsan: 1 race found, 2 occurrences", err)
    assert m, repr(err[:200])
    assert len(m.group(2)) == len(m.group(0).split("\r")[1])  # the clearing covers the whole line


def test_replay_status_line_only_on_a_tty(capsys, tmp_path, monkeypatch):
    trace = write_trace(tmp_path / "t.sstrace", [S.pinned_d2h_then_h2d()])
    assert main(["replay", str(trace)]) == 0
    assert capsys.readouterr().err == ""  # captured stderr is no terminal
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["replay", str(trace)]) == 0
    text = f"streamsan: analyzing {trace}: {len(S.pinned_d2h_then_h2d())} events, 1 finding so far"
    assert tty.getvalue() == f"\r{text}\r{' ' * len(text)}\r"


@pytest.fixture
def restore_logger():
    log = logging.getLogger("streamsan")
    handlers, level = list(log.handlers), log.level
    yield
    log.handlers[:] = handlers
    log.setLevel(level)


def test_verbose_shows_the_loggers_diagnostics(capsys, tmp_path, monkeypatch, restore_logger):
    for key in ("FORMAT", "FAIL_ON_RACE", "SUPPRESSIONS"):
        monkeypatch.delenv(f"STREAMSAN_{key}", raising=False)
    monkeypatch.chdir(tmp_path)
    trace = write_trace(tmp_path / "t.sstrace", [S.pinned_d2h_then_h2d()])
    supp = tmp_path / "s.supp"
    supp.write_text("kind:host-device  # not here\n")
    assert main(["-v", "replay", str(trace), "--suppressions", str(supp)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "streamsan: debug: option format = 'text' from the default",
        "streamsan: debug: option fail_on_race = False from the default",
        "streamsan: debug: option allow_incomplete = False from the default",
        f"streamsan: debug: option suppressions = '{supp}' from the command line",
        f"streamsan: debug: 1 suppression rules from {supp}",
        f"streamsan: debug: {trace}: {len(S.pinned_d2h_then_h2d())} events, 1 finding",
    ]


def test_library_code_prints_nothing(capfd, tmp_path):
    trace = write_trace(tmp_path / "t.sstrace", [S.pinned_d2h_then_h2d()])
    assert replay_trace(str(trace))["summary"]["races"] == 1
    assert capfd.readouterr() == ("", "")
