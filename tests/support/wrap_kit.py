"""Shared by the tests of ``streamsan wrap``'s outputs and exit codes: the stand-in traced program of
``test_wrap`` (it writes its trace itself, without the tracer) and a way to run wrap in-process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent

from streamsan.cli import main  # noqa: E402
from test_wrap import CHILD  # noqa: E402


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
