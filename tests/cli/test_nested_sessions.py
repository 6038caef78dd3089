"""A session started while another is active joins it, with one note, and never breaks the program:
``watch()`` in ``watch()``, ``enable()`` twice, ``watch()`` and ``pytest --streamsan`` under ``streamsan wrap``.
A joined session's findings are the active session's over its own span (hand-made events, no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import streamsan
from streamsan import session as SS
from tests.support import report_scenarios as S
from tests.support.paths import ROOT

JOINED_LINE = f"streamsan: {SS.JOINED}\n"
RECORDING_LINE = f"streamsan: {SS.JOINED_RECORDING}\n"
NO_CUDA = "streamsan: no CUDA device is available: nothing could be checked (the program ran unchanged)\n"


def notes(err: str) -> str:
    """stderr without the outer session's no-CUDA note (said when torch was imported, as here without a GPU)."""
    return err.replace(NO_CUDA, "")


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    monkeypatch.setattr(SS, "_said", set())


def races(n: int, first: int = 0) -> list:
    """n occurrences of the pinned D2H -> H2D race (one finding), without the stream and stack definitions
    when ``first`` > 0 (they were given already)."""
    evs = S.pinned_d2h_then_h2d(first + n)
    prologue = len(S.prologue())
    return evs[:prologue] + evs[prologue + 4 * first:] if first == 0 else evs[prologue + 4 * first:]


def feed(session, events) -> None:
    session.buffer.events.extend(events)
    session.buffer.flush()


def test_watch_inside_watch_joins_and_counts_its_own_span(capsys):
    with streamsan.watch(helper=False) as outer:
        feed(outer, races(2))
        with streamsan.watch(helper=False) as inner:
            feed(outer, races(3, first=2))
            assert [f.count for f in inner.findings] == [3]
        feed(outer, races(1, first=5))
    assert notes(capsys.readouterr().err) == JOINED_LINE
    assert [f.count for f in outer.findings] == [6]
    assert [f.count for f in inner.findings] == [3]  # (kept as of the inner block's end)
    rep = inner.report()
    assert rep["summary"]["races"] == 1 and rep["races"][0]["count"] == 3 and rep["complete"] is True
    assert SS.current() is None


def test_a_joined_session_without_new_findings_has_none(capsys):
    with streamsan.watch(helper=False) as outer:
        feed(outer, races(2))
        with streamsan.watch(helper=False) as inner:
            pass
    assert inner.findings == [] and inner.report()["races"] == []
    assert len(outer.findings) == 1


def test_enable_twice_joins_and_disable_stops_the_last(capsys):
    first = streamsan.enable(helper=False)
    try:
        second = streamsan.enable(helper=False)
        assert second is not first and SS.current() is first
        assert streamsan.disable() is second and first.active and not second.active
    finally:
        assert streamsan.disable() is first
    assert not first.active and SS.current() is None
    assert notes(capsys.readouterr().err) == JOINED_LINE  # one note, however often it joins


def test_a_joined_session_writes_no_trace_of_its_own(capsys, tmp_path):
    with streamsan.watch(helper=False):
        with streamsan.watch(helper=False, trace=str(tmp_path / "inner.sstrace")):
            pass
    assert not (tmp_path / "inner.sstrace").exists()
    assert notes(capsys.readouterr().err) == (f"streamsan: {SS.JOINED}; no trace is written to "
                                       f"{tmp_path / 'inner.sstrace'}\n")


def _wrap(tmp_path, *cmd):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "streamsan", "wrap", "--", *cmd], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_watch_under_wrap_joins_wraps_recording(tmp_path):
    (tmp_path / "t.py").write_text(textwrap.dedent("""
        import streamsan
        with streamsan.watch() as s:
            pass
        streamsan.enable()
        print(s.findings, s.complete, streamsan.disable().complete)
    """))
    p = _wrap(tmp_path, sys.executable, "t.py")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "[] False False\n"
    assert "Traceback" not in p.stderr and p.stderr.startswith(RECORDING_LINE), p.stderr
    assert p.stderr.count(RECORDING_LINE) == 1


def test_pytest_streamsan_under_wrap_runs_the_tests(tmp_path):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
        import streamsan

        def test_with_watch():
            with streamsan.watch() as s:
                pass
            assert s.findings == []
    """))
    p = _wrap(tmp_path, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--streamsan",
              "--streamsan-report", "inner-report.json", "test_inner.py")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed" in p.stdout and "Traceback" not in p.stderr
    assert RECORDING_LINE in p.stderr
