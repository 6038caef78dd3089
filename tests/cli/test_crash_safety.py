"""Crash safety through the real ``streamsan wrap`` on the CPU: the program raises, calls ``sys.exit(n)`` or
``os._exit(n)``, or is killed by SIGTERM, SIGINT or SIGKILL; the exit status is propagated, the report is
written, and it says what happened: complete when streamsan could finish the trace, else incomplete with the
events up to the last flushed batch.

The traced program is a real Python process started through the bootstrap (no ``-S``), and imports torch (CPU
build: streamsan still records, with its "no CUDA" note). It feeds hand-made events into the session's buffer
(``streamsan.session.current()`` is the session the bootstrap started): a flushed batch of 20 events with a
race of 2 occurrences, then 4 more events (a third occurrence) left in the buffer, unflushed. So the report's
event count says exactly how much of the trace survived:

* 25 events (20 + 4 + the "no CUDA" NOTE written when the session stops): streamsan finished the trace;
* 20 events: only the flushed batch survived (the process died without running any exit code).

Two modes send the signal while the program is inside a flush (the worst moment: the buffer's lock held, a
frame being written), and the last test fills the disk under the writer.

Every wrap runs at once in a module fixture (each in its own directory) so that the torch imports overlap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from streamsan import exitcodes
from tests.support import report_scenarios as S
from tests.support.paths import ROOT

NO_CUDA = "no CUDA device is available: nothing could be checked (the program ran unchanged)"
FLUSHED = len(S.pinned_d2h_then_h2d(2))  # 20
PENDING = len(S.pinned_d2h_then_h2d(1)) - len(S.prologue())  # 4
ALL = FLUSHED + PENDING + 1  # + the NOTE

PROGRAM = textwrap.dedent(f"""
    import os, signal, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    from tests.support import report_scenarios as S
    import streamsan.session
    import torch

    mode = sys.argv[1]
    s = streamsan.session.current()
    assert s is not None and s.writer is not None, "the bootstrap started no session"
    s.buffer.events.extend(S.pinned_d2h_then_h2d(2))
    s.buffer.flush()
    pending = S.pinned_d2h_then_h2d(1)[len(S.prologue()):]
    if mode.endswith("-in-flush"):
        # The signal arrives while the pending batch is being written (the buffer's lock held).
        sig = signal.SIGTERM if mode == "term-in-flush" else signal.SIGINT
        write = s.writer.write

        def interrupted_write(batch):
            s.buffer.consumers = [write]  # once
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler runs here, inside the flush
            write(batch)

        s.buffer.consumers = [interrupted_write]
        s.buffer.events.extend(pending)
        s.buffer.flush()
        sys.exit(99)  # not reached
    s.buffer.events.extend(pending)  # left unflushed
    print("x = %.1f" % torch.ones(2).sum().item(), flush=True)
    if mode == "raise":
        raise RuntimeError("the program failed")
    if mode == "sys-exit":
        sys.exit(3)
    if mode == "os-exit":
        os._exit(4)
    if mode == "posix-exit":  # bypasses streamsan's os._exit: like a C extension calling _exit()
        import posix
        posix._exit(5)
    os.kill(os.getpid(), getattr(signal, "SIG" + mode.upper()))
    time.sleep(5)
    sys.exit(98)  # not reached
""")

MODES = ["raise", "sys-exit", "os-exit", "posix-exit", "term", "int", "kill", "term-in-flush", "int-in-flush"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{mode: (exit status, stdout, stderr, report)} of ``streamsan wrap -- python program.py MODE``."""
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("crash")
    program = base / "program.py"
    program.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = {}
    for mode in MODES:
        d = base / mode
        d.mkdir()
        procs[mode] = subprocess.Popen(
            [sys.executable, "-m", "streamsan", "wrap", "--report", "r.json", "--",
             sys.executable, str(program), mode],
            cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out = {}
    deadline = time.monotonic() + 60
    for mode, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
            out[mode] = ("hang", stdout, stderr, None)
            continue
        report = base / mode / "r.json"
        out[mode] = (p.returncode, stdout, stderr, json.loads(report.read_text()) if report.exists() else None)
    return out


def one(runs, mode, expected_code):
    code, stdout, stderr, rep = runs[mode]
    assert code == expected_code, f"{mode}: exit {code}\n{stderr}"
    assert rep is not None, f"{mode}: no report\n{stderr}"
    assert rep["schema"] == "streamsan.report/1" and len(rep["processes"]) == 1
    signals = {exitcodes.SIGNAL + s: s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)}
    assert rep["exit_status"] == {"code": expected_code, "signal": signals.get(expected_code)}, mode
    return stdout, stderr, rep


def assert_finished(rep, notes=True):
    """The trace was finished (end mark): complete, every event, the third occurrence included."""
    assert rep["complete"] is True and rep["problems"] == [], rep["problems"]
    assert rep["summary"]["events"] == ALL
    assert [(r["kind"], r["count"]) for r in rep["races"]] == [("device-device", 3)]
    assert rep["notes"] == [{"level": "warning", "text": NO_CUDA}]


def assert_cut(rep, problem):
    """The process died without finishing the trace: incomplete, only the flushed batch."""
    trace = rep["processes"][0]["trace"]
    assert rep["complete"] is False and rep["problems"] == [f"{trace}: {problem}"]
    assert [(r["kind"], r["count"]) for r in rep["races"]] == [("device-device", 2)]


def test_program_raises(runs):
    stdout, stderr, rep = one(runs, "raise", 1)
    assert stdout == "x = 2.0\n"
    assert "RuntimeError: the program failed" in stderr
    assert_finished(rep)


def test_program_calls_sys_exit(runs):
    _, _, rep = one(runs, "sys-exit", 3)
    assert_finished(rep)


def test_program_calls_os_exit(runs):
    """streamsan's os._exit finishes the trace first."""
    _, _, rep = one(runs, "os-exit", 4)
    assert_finished(rep)


def test_program_exits_past_streamsan(runs):
    """An _exit streamsan does not see (posix._exit, or C code): the trace is read up to the last flushed event."""
    _, _, rep = one(runs, "posix-exit", 5)
    assert rep["summary"]["events"] == FLUSHED
    assert_cut(rep, f"the trace has no end mark after {FLUSHED} events (the traced process did not exit normally)")


def test_program_killed_by_sigterm(runs):
    """streamsan's SIGTERM handler finishes the trace, then dies of the signal."""
    _, _, rep = one(runs, "term", exitcodes.SIGNAL + signal.SIGTERM)
    assert_finished(rep)


def test_program_killed_by_sigint(runs):
    """Python's KeyboardInterrupt unwinds the program; atexit finishes the trace; Python dies of SIGINT."""
    _, stderr, rep = one(runs, "int", exitcodes.SIGNAL + signal.SIGINT)
    assert "KeyboardInterrupt" in stderr
    assert_finished(rep)


def test_program_killed_by_sigkill(runs):
    _, stderr, rep = one(runs, "kill", exitcodes.SIGNAL + signal.SIGKILL)
    assert rep["summary"]["events"] == FLUSHED and rep["notes"] == []
    assert_cut(rep, f"the trace has no end mark after {FLUSHED} events (the traced process did not exit normally)")


def test_sigterm_while_writing_the_trace_does_not_hang(runs):
    """SIGTERM arrives while the program is inside a flush: stopping would wait for the buffer's lock forever.
    The program dies of the signal at once, the trace without its end mark."""
    _, _, rep = one(runs, "term-in-flush", exitcodes.SIGNAL + signal.SIGTERM)
    assert rep["summary"]["events"] == FLUSHED
    assert_cut(rep, f"the trace has no end mark after {FLUSHED} events (the traced process did not exit normally)")


def test_sigint_while_writing_the_trace_loses_a_batch_and_says_so(runs):
    """KeyboardInterrupt inside a flush loses the batch being written; atexit still finishes the trace, which
    must then not claim to be complete."""
    _, _, rep = one(runs, "int-in-flush", exitcodes.SIGNAL + signal.SIGINT)
    assert rep["summary"]["events"] == FLUSHED + 1  # the NOTE written at exit
    assert rep["notes"] == [{"level": "warning", "text": NO_CUDA}]
    assert_cut(rep, f"{PENDING} events were lost when the traced process was interrupted while writing them")


def test_wrap_says_what_happened_once(runs):
    """streamsan's lines on stderr: the parent's summary, its warnings, where the report is; the child's own
    "no CUDA" note is not repeated (each thing said once)."""
    from streamsan.report.render_text import totals_text

    for mode in MODES:
        _, _, stderr, rep = runs[mode]
        lines = [ln for ln in stderr.splitlines() if ln.startswith("streamsan:")]
        expected = [totals_text(rep)]
        expected += [f"streamsan: warning: the report is incomplete: {p}" for p in rep["problems"]]
        expected += [f"streamsan: warning: {n['text']}" for n in rep["notes"]]
        assert lines == expected + ["streamsan: report written to r.json"], mode
        assert sum(NO_CUDA in ln for ln in stderr.splitlines()) == len(rep["notes"]), mode


def test_a_trace_that_cannot_be_written_never_breaks_the_program(tmp_path, capsys):
    """The disk fills up while tracing: the program sees nothing, streamsan warns once and stops writing,
    and the trace is read up to the last frame that was written."""
    from streamsan.replay import replay_trace
    from streamsan.sink import EventBuffer
    from streamsan.trace import TraceWriter

    path = tmp_path / "t.sstrace"
    w = TraceWriter(str(path), {"command": ["python", "run.py"]})
    buf = EventBuffer([w.write])
    buf.events.extend(S.pinned_d2h_then_h2d(2))
    buf.flush()
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, w.fd)  # from now on every write fails with ENOSPC
    os.close(full)
    for _ in range(3):
        buf.events.extend(S.pinned_d2h_then_h2d(1)[len(S.prologue()):])
        buf.flush()
    w.close({"environment": {}})
    assert capsys.readouterr().err == (f"streamsan: warning: cannot write the trace {path} (No space left on "
                                       "device): tracing stopped, the report will be incomplete\n")
    rep = replay_trace(str(path))
    assert rep["complete"] is False and rep["summary"]["events"] == FLUSHED
    assert rep["problems"] == [f"{path}: the trace has no end mark after {FLUSHED} events (the traced process did "
                               "not exit normally)"]
