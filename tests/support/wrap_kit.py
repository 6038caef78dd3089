"""Shared by the tests of ``streamsan wrap``: a stand-in traced program (it writes its trace itself, without the
tracer), the fixture that runs it, and a way to run wrap in-process."""

from __future__ import annotations

import sys
import textwrap

import pytest

from streamsan.cli import main
from tests.support.paths import ROOT

CHILD = textwrap.dedent(f"""
    import os, signal, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    from tests.support import report_scenarios as S
    from streamsan.trace import TraceWriter

    mode, code = sys.argv[1], int(sys.argv[2])
    session = os.environ["STREAMSAN_SESSION_DIR"]
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "seen.json"), "w") as f:
        f.write('{{"session": "%s", "scope": "%s"}}' % (session, os.environ["STREAMSAN_SCOPE"]))
    w = TraceWriter(os.path.join(session, "trace-%d.sstrace" % os.getpid()), {{"command": sys.argv}})
    w.write(S.host_read_after_d2h(synchronized=True) if mode == "clean" else S.pinned_d2h_then_h2d(2))
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sleep":
        print("ready", flush=True)
        time.sleep(60)
    w.close()
    sys.exit(code)
""")


@pytest.fixture
def child(tmp_path, monkeypatch):
    """The stand-in traced program (``MODE CODE``: race, clean, kill, sleep); returns the command that runs it."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return [sys.executable, "-S", str(path)]


def run(capfd, *argv):
    """``streamsan ARGV...`` in-process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return code, out, err
