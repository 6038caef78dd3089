"""A process of the wrapped command still running when wrap stops waiting for it (a child left in the
background) makes the report incomplete, named as still running: whether it had written a trace yet or not."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import pytest

import streamsan.wrap
from tests.support.wrap_kit import child, run  # noqa: F401

BACKGROUND = textwrap.dedent("""
    import subprocess, sys
    p = subprocess.Popen([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"],
                         stdout=subprocess.PIPE, text=True)
    p.stdout.readline()  # it runs (and traces) before we exit
    open("bg.pid", "w").write(str(p.pid))
""")


@pytest.fixture
def background(tmp_path, monkeypatch):
    monkeypatch.setattr(streamsan.wrap, "WRITERS_WAIT_S", 0.5)
    (tmp_path / "bg.py").write_text(BACKGROUND)
    yield tmp_path / "bg.pid"
    if (tmp_path / "bg.pid").exists():
        try:
            os.kill(int((tmp_path / "bg.pid").read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_child_still_running_makes_the_report_incomplete(capfd, child, tmp_path, background):
    code, _, err = run(capfd, "wrap", "--", sys.executable, "bg.py")
    assert code == 0, err
    pid = int(background.read_text())
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert rep["complete"] is False
    (mine,) = [p for p in rep["problems"] if f"process {pid}" in p]
    assert mine == (f"trace-{pid}.sstrace: process {pid} was still running when wrap stopped waiting for it (the "
                    f"events it wrote until then were analyzed)")
    assert not any("has no end mark" in p for p in rep["problems"])
    assert f"streamsan: warning: the report is incomplete: {mine}" in err


def test_a_child_that_had_not_started_tracing_is_named_too(monkeypatch, tmp_path):
    monkeypatch.setattr(streamsan.wrap, "_session_processes", lambda d: {os.getppid()})
    monkeypatch.setattr(streamsan.wrap, "_command_line", lambda pid: "python slow.py")
    running = streamsan.wrap.wait_for_writers(str(tmp_path), timeout=0.05)
    assert running == {os.getppid(): "python slow.py"}
    rep = streamsan.wrap.collect_report(str(tmp_path), ["python", "x.py"], still_running=running)
    assert rep["complete"] is False and rep["problems"] == [
        f"process {os.getppid()} (python slow.py) was still running when wrap stopped waiting for it, before it "
        f"wrote a trace"]
