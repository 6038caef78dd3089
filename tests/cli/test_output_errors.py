"""An output that cannot be written (a full disk, a closed standard output) is one error line about the
output, exit 2: never a traceback, never blamed on the input."""

from __future__ import annotations

import os
import subprocess
import sys

from streamsan.trace import TraceWriter
from tests.support import report_scenarios as S
from tests.support.paths import ROOT


def streamsan(shell_tail: str, cwd) -> subprocess.CompletedProcess:
    """``python -m streamsan ...`` run by a shell, for its redirections."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(["sh", "-c", f'"{sys.executable}" -m streamsan {shell_tail}'], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def inputs(tmp_path):
    w = TraceWriter(str(tmp_path / "t.sstrace"), {"command": ["python", "run.py"]})
    w.write(S.pinned_d2h_then_h2d())
    w.close()
    p = streamsan("replay t.sstrace --report r.json", tmp_path)
    assert p.returncode == 0, p.stderr


def test_replay_and_show_into_a_full_disk(tmp_path):
    inputs(tmp_path)
    for cmd in ("replay t.sstrace", "show r.json", "show r.json --format html"):
        p = streamsan(f"{cmd} > /dev/full", tmp_path)
        assert (p.returncode, p.stderr) == (
            2, "streamsan: error: cannot write the standard output: No space left on device\n"), cmd


def test_show_into_a_closed_standard_output(tmp_path):
    inputs(tmp_path)
    p = streamsan("show r.json >&-", tmp_path)
    assert (p.returncode, p.stderr) == (2, "streamsan: error: cannot write the standard output: standard output "
                                           "is closed\n")


def test_a_pipe_closed_early_is_no_error(tmp_path):
    inputs(tmp_path)
    p = streamsan("show r.json --format json | head -c 1 > /dev/null", tmp_path)
    assert p.returncode == 0 and p.stderr == ""
