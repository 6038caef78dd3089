"""Analysis in a helper process (streamsan.helper): the same findings as in-process analysis, live queries, and
no harm to the program when the helper cannot start, dies, or the program forks."""

import os
from pathlib import Path

import pytest

from streamsan import events as E
from streamsan.analysis.analyzer import Analyzer
from streamsan.helper import AnalysisHelper
from streamsan.session import Session
from streamsan.trace import TraceReader
from tests.support.fixtures import trace

TRACES = ["torch_scenarios/missing_record_stream", "cupy_scenarios/nonblocking_streams_race",
          "torch_scenarios/wait_stream_right", "torch_scenarios/d2h_then_h2d_pinned_across_streams",
          "collectives_devices_threads_triton/collective-async_allreduce_then_use",
          "collectives_devices_threads_triton/loader_thread_without_handoff_races"]


def summary(analyzer):
    return [(f.kind, f.previous.agent, f.previous.name, f.current.agent, f.current.name, f.lo, f.hi, f.count)
            for f in analyzer.sorted_findings()]


def batches(key):
    return list(TraceReader(str(trace(key))).batches())


@pytest.mark.parametrize("name", TRACES)
def test_the_helper_finds_what_in_process_analysis_finds(name):
    inline = Analyzer()
    helper = AnalysisHelper()
    for b in batches(name):
        inline.feed(b)
        helper.feed(b)
    inline.finish()
    remote, problems = helper.finish()
    assert problems == [] and helper.problem is None
    assert summary(remote) == summary(inline)
    assert bool(summary(inline)) == (name != "torch_scenarios/wait_stream_right")  # the comparison means something
    assert {a: i.name for a, i in remote.agents.items()} == {a: i.name for a, i in inline.agents.items()}


def synthetic_race():
    """A write on stream 1, then an unordered write on stream 2 of the same bytes."""
    r = E.rng(0, 0x1000, 256)
    return [E.stream(1, 0, 0x10), E.stream(2, 0, 0x20, name="side"),
            E.op(1, "aten::fill_.Scalar", writes=[r]), E.op(2, "aten::add_.Tensor", writes=[r])]


def test_a_helper_session_answers_while_active_and_after_stop():
    s = Session(helper=True).start()
    try:
        assert s._helper is not None and s._helper.alive
        s.buffer.events.extend(synthetic_race())
        live = [(f.kind, f.previous.name, f.current.name) for f in s.findings]
        assert live == [("device-device", "aten::fill_.Scalar", "aten::add_.Tensor")]
    finally:
        s.stop()
    assert s._helper is None
    assert [(f.kind, f.previous.name, f.current.name) for f in s.findings] == live
    assert s.complete and s.report()["races"][0]["access"]["agent"]["role"] == "side"


def test_a_helper_that_dies_leaves_the_program_running_and_the_report_incomplete():
    s = Session(helper=True).start()
    try:
        s.buffer.events.extend(synthetic_race()[:3])
        s.buffer.flush()
        s._helper._proc.kill()
        s._helper._proc.wait()
        s.buffer.events.extend(synthetic_race()[3:])
        s.buffer.flush()  # writes into a dead pipe: no exception reaches the program
    finally:
        s.stop()
    assert not s.complete
    assert any(p.startswith("the analysis helper stopped") for p in s.problems), s.problems
    report = s.report()
    assert report["complete"] is False and report["races"] == []


def test_when_the_helper_cannot_start_the_session_analyzes_in_process(monkeypatch):
    import subprocess

    def refuse(*a, **k):
        raise OSError("no processes left")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    s = Session(helper=True).start()
    try:
        assert s._helper is None
        s.buffer.events.extend(synthetic_race())
    finally:
        s.stop()
    assert s.complete
    assert [(f.kind, f.previous.name, f.current.name) for f in s.findings] == [
        ("device-device", "aten::fill_.Scalar", "aten::add_.Tensor")]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_writes_to_its_parents_helper():
    helper = AnalysisHelper()
    events = synthetic_race()
    helper.feed(events[:3])
    pid = os.fork()
    if pid == 0:  # the child feeds the race's second half: it must not reach the parent's helper
        helper.feed(events[3:])
        helper.snapshot()
        os._exit(0)
    os.waitpid(pid, 0)
    analyzer, problems = helper.finish()
    assert problems == [] and helper.problem is None
    assert analyzer.findings == {} and analyzer.seq == 3


def test_the_helper_does_not_trace_itself_under_wrap(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMSAN_SESSION_DIR", str(tmp_path))
    helper = AnalysisHelper()
    helper.feed(synthetic_race())
    analyzer, _ = helper.finish()
    assert [(f.kind, f.previous.name, f.current.name) for f in analyzer.sorted_findings()] == [
        ("device-device", "aten::fill_.Scalar", "aten::add_.Tensor")]
    assert list(tmp_path.iterdir()) == []  # no trace file of the helper's own


@pytest.mark.skipif(not hasattr(os, "kill") or os.name != "posix", reason="needs POSIX signals")
def test_a_stuck_helper_is_given_up_after_the_reply_timeout(monkeypatch):
    import signal

    import streamsan.helper as helper_module

    monkeypatch.setattr(helper_module, "REPLY_TIMEOUT", 0.5)
    helper = AnalysisHelper()
    helper.feed(synthetic_race())
    os.kill(helper._proc.pid, signal.SIGSTOP)  # alive, but it will never answer
    analyzer, problems = helper.snapshot()
    assert analyzer is None and problems == []
    assert helper.problem == ("the analysis helper stopped (TimeoutError: no answer in 0.5 s): events after that "
                              "were not analyzed")
    assert helper.finish() == (None, [])


def _pipe_max() -> int:
    try:
        return int(Path("/proc/sys/fs/pipe-max-size").read_text())
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(_pipe_max() < 1 << 20, reason="Linux pipes that may hold 1 MiB")
def test_the_pipe_to_the_helper_holds_many_batches():
    """A 512-event batch is about 30 KB marshalled; the default 64 KiB pipe would make the program wait for the
    helper whenever it analyzes a batch more slowly than the next one is made."""
    import fcntl

    from streamsan.helper import PIPE_BYTES

    h = AnalysisHelper()
    try:
        assert fcntl.fcntl(h._proc.stdin.fileno(), getattr(fcntl, "F_GETPIPE_SZ", 1032)) >= PIPE_BYTES
    finally:
        h.finish()
