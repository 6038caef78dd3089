"""Without a GPU, or with a torch streamsan does not support, ``streamsan wrap`` runs the program unchanged and
says exactly once why nothing was checked (the traced process records the reason in its trace and stays
quiet; the wrapping process's report says it).

These run on a machine without CUDA (the CPU build of torch, or a stub ``torch`` package); on a GPU machine the
first test is skipped.
"""

from __future__ import annotations

import json
import sys

import pytest

from streamsan.cli import main
from streamsan.tracers.support import NO_CUDA
from tests.support.paths import ROOT


def wrap(capfd, *cmd):
    code = main(["wrap", "--", *cmd])
    out, err = capfd.readouterr()
    return code, out, err


def test_without_cuda_the_program_runs_unchanged_and_streamsan_says_so_once(capfd, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    code, out, err = wrap(capfd, sys.executable, "-c",
                          "import torch; x = torch.ones(3); print(x.sum().item())")
    assert code == 0 and out == "3.0\n"
    ours = [line for line in err.splitlines() if line.startswith("streamsan")]  # torch may warn too (no numpy)
    assert ours == ["streamsan: no races found (1 event, 0 stream ops, 0 streams).",
                    f"streamsan: warning: {NO_CUDA}",
                    "streamsan: report written to streamsan-report.json"]
    assert err.count("nothing could be checked") == 1
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert rep["complete"] is True and rep["races"] == []
    assert rep["notes"] == [{"level": "warning", "text": NO_CUDA}]


def test_an_unsupported_torch_runs_unchanged_and_streamsan_says_so_once(capfd, tmp_path, monkeypatch):
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('__version__ = "1.13.0"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f"{stub.parent}:{ROOT}")
    code, out, err = wrap(capfd, sys.executable, "-c",
                          "import torch, sys; print(torch.__version__, torch.__file__); sys.exit(7)")
    assert code == 7 and out == f"1.13.0 {stub / '__init__.py'}\n"
    why = ("torch 1.13.0 is not supported (streamsan needs torch >= 2.4): nothing could be checked (the program "
           "ran unchanged)")
    assert err == ("streamsan: no races found (1 event, 0 stream ops, 0 streams).\n"
                   f"streamsan: warning: {why}\n"
                   "streamsan: report written to streamsan-report.json\n")
    assert err.count("nothing could be checked") == 1
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert rep["complete"] is True and rep["notes"] == [{"level": "warning", "text": why}]
