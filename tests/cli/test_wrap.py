"""``streamsan wrap``: the parent side (run, collect, merge, exit codes, signals) and the bootstrap.

Most children here run with ``python -S`` (no ``site``, so no bootstrap) and write their trace themselves
with TraceWriter, as a stand-in for ``streamsan.session.start_from_env``; that keeps the parent's tests
independent of the tracer. The last tests run the real bootstrap.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

from streamsan import exitcodes
from streamsan.cli import main
from streamsan.wrap import BOOTSTRAP_DIR
from tests.support.paths import ROOT
from tests.support.wrap_kit import CHILD, child  # noqa: F401  (child: a fixture)


def wrap(capfd, *argv):
    code = main(["wrap", *map(str, argv)])
    out, err = capfd.readouterr()
    return code, out, err


def assert_one_error(code, err, expected, fragment):
    assert code == expected, err
    assert err.startswith("streamsan: error: ") and err.count("\n") == 1 and fragment in err, err


def test_wrap_reports_and_exits_with_the_childs_code(capfd, child, tmp_path):
    code, _, err = wrap(capfd, "--report", "r.json", "--trace", "kept.sstrace", "--scope", "hooks", "--",
                        *child, "race", 3)
    assert code == 3, err
    assert "streamsan: 1 race found, 2 occurrences" in err
    assert "streamsan: report written to r.json" in err and "trace kept in kept.sstrace" in err
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["command"] == [*child, "race", "3"] and "command" not in rep["environment"]
    assert rep["complete"] is True and rep["races"][0]["count"] == 2
    (proc,) = rep["processes"]
    assert proc["complete"] is True and proc["trace"].startswith("trace-") and proc["pid"] > 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["scope"] == "hooks"
    assert not os.path.exists(seen["session"])  # cleaned up
    assert (tmp_path / "kept.sstrace").read_bytes().startswith(b"SSTRACE1")


def test_wrap_default_report_path_and_fail_on_race(capfd, child, tmp_path):
    code, _, err = wrap(capfd, "--fail-on-race", *child, "race", 0)
    assert code == exitcodes.RACES, err
    assert json.loads((tmp_path / "streamsan-report.json").read_text())["races"]
    code, _, err = wrap(capfd, "--fail-on-race", "--", *child, "clean", 0)
    assert code == 0 and "no races found" in err


def test_wrap_markdown_goes_to_stderr(capfd, child):
    code, out, err = wrap(capfd, "--format", "markdown", "--", *child, "race", 0)
    assert code == 0 and out == "" and "## streamsan: 1 CUDA stream race found" in err


def test_wrap_child_killed_by_a_signal(capfd, child, tmp_path):
    code, _, err = wrap(capfd, "--", *child, "kill", 0)
    assert code == exitcodes.SIGNAL + signal.SIGKILL
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert rep["complete"] is False and "no end mark" in rep["problems"][0]
    assert rep["problems"][0].startswith("trace-")  # the file's name, not the deleted session path
    assert len(rep["races"]) == 1 and "the report is incomplete" in err


def test_wrap_python_dash_m_and_a_console_script(capfd, child, tmp_path, monkeypatch):
    (tmp_path / "fakemod.py").write_text(CHILD)
    code, _, err = wrap(capfd, "--", sys.executable, "-S", "-m", "fakemod", "race", 5)
    assert code == 5 and "1 race found" in err
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "fake-console"
    script.write_text(f'#!/bin/sh\nexec {" ".join(child)} "$@"\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    code, _, err = wrap(capfd, "--", "fake-console", "race", 0)
    assert code == 0 and "1 race found" in err


def test_wrap_of_a_program_that_writes_no_trace(capfd, child, tmp_path):
    code, _, err = wrap(capfd, "--", "true")
    assert code == 0
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert rep["complete"] is False and "no process wrote a trace" in rep["problems"][0]
    assert rep["processes"] == [] and rep["environment"]["streamsan"]


def test_wrap_errors(capfd, child, tmp_path):
    assert_one_error(*wrap(capfd)[::2], exitcodes.USAGE, "wrap needs a command")
    assert_one_error(*wrap(capfd, "--")[::2], exitcodes.USAGE, "wrap needs a command")
    assert_one_error(*wrap(capfd, "--", "no-such-program-xyz")[::2], exitcodes.NOT_FOUND,
                     "no-such-program-xyz: command not found")
    (tmp_path / "notexec").write_text("echo hi\n")
    assert_one_error(*wrap(capfd, "--", "./notexec")[::2], exitcodes.NOT_EXECUTABLE, "./notexec: permission denied")
    assert_one_error(*wrap(capfd, "--bogus", "--", *child, "race", 0)[::2], exitcodes.USAGE,
                     "unrecognized arguments: --bogus")


def test_wrap_checks_its_outputs_before_running(capfd, child, tmp_path):
    (tmp_path / "file").write_text("")
    assert_one_error(*wrap(capfd, "--report", tmp_path / "file" / "r.json", "--", *child, "race", 0)[::2],
                     exitcodes.USAGE, "is not a directory")
    assert_one_error(*wrap(capfd, "--trace", tmp_path / "file" / "t", "--", *child, "race", 0)[::2],
                     exitcodes.USAGE, "is not a directory")
    assert not (tmp_path / "seen.json").exists()  # the command never ran


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_wrap_forwards_signals_to_the_child(child, tmp_path, sig):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "streamsan", "wrap", "--", *child, "sleep", "0"], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # no terminal: the parent must forward
    try:
        assert p.stdout.readline() == "ready\n"
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == exitcodes.SIGNAL + sig, err
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert rep["complete"] is False and len(rep["races"]) == 1


# ---------------------------------------------------------------- the bootstrap
def test_bootstrap_chains_to_the_environments_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('their sitecustomize ran')\n")
    prog = ("import sys, sitecustomize; print(sitecustomize.__file__); "
            f"print({BOOTSTRAP_DIR!r} in sys.path)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([BOOTSTRAP_DIR, str(other), str(ROOT)]))
    env.pop("STREAMSAN_SESSION_DIR", None)
    p = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout.splitlines() == ["their sitecustomize ran", str(other / "sitecustomize.py"), "False"]


def test_bootstrap_survives_a_broken_environment_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("raise RuntimeError('broken')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([BOOTSTRAP_DIR, str(other), str(ROOT)]))
    env.pop("STREAMSAN_SESSION_DIR", None)
    p = subprocess.run([sys.executable, "-c", "print('ok')"], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "ok\n"
    assert p.stderr == "streamsan: warning: the environment's sitecustomize failed: RuntimeError: broken\n"


def test_bootstrap_never_breaks_the_program(monkeypatch, capsys, tmp_path):
    import streamsan.session

    def fail():
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(streamsan.session, "start_from_env", fail)
    monkeypatch.setenv("STREAMSAN_SESSION_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("sitecustomize", os.path.join(BOOTSTRAP_DIR, "sitecustomize.py"))
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sitecustomize", mod)
    spec.loader.exec_module(mod)
    err = capsys.readouterr().err
    assert err == f"streamsan: warning: tracing not started in process {os.getpid()}: RuntimeError: no CUDA here\n"


def test_wrap_traces_real_python_subprocesses(capfd, tmp_path, monkeypatch):
    """The real bootstrap and session: a Python program and its Python child each leave a trace."""
    monkeypatch.chdir(tmp_path)
    prog = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', 'pass']).returncode + 4)"
    code, _, err = wrap(capfd, "--", sys.executable, "-c", prog)
    assert code == 4, err
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert len(rep["processes"]) == 2, rep["problems"]
    assert rep["complete"] is True and rep["races"] == []
