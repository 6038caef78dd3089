"""``pytest --streamsan`` on inner test files (pytester, in subprocesses) whose tests feed hand-made events to
the session's buffer, so no GPU is needed: a racy test fails with the finding's paragraph, a clean one
passes, one combined report is written; configuration, suppressions and the kept trace."""

from __future__ import annotations

import json
import textwrap

import pytest

from streamsan.config import OPTIONS
from tests.support import report_scenarios as S
from tests.support.paths import ROOT
from tests.support.report_kit import validator

pytest_plugins = ["pytester"]

INNER = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(ROOT)!r})
    from tests.support import report_scenarios as S
    import streamsan.session

    def feed(events):
        s = streamsan.session.current()
        if s is not None:
            s.buffer.events.extend(events)

    def test_racy():
        feed(S.pinned_d2h_then_h2d())

    def test_clean():
        feed(S.host_read_after_d2h(synchronized=True)[len(S.prologue()):])

    def test_no_torch_imported():
        assert "torch" not in sys.modules
""")

PARAGRAPH = [
    "streamsan: 1 new CUDA stream race during this test:",
    "",
    "[1] device-device x1 on pinned-host memory 0x1000-0x2000 (4096 bytes, cache.layers[3].keys, "
    "bfloat16[1, 8, 2, 128])",
    "    earlier: write aten::copy_ on the default stream (0x0) at u/proj/cache_utils.py:120  "
    "[transformers Cache.offload(layer_idx=3)]",
    f"    later:   read aten::copy_ on prefetch_stream ({hex(S.PREFETCH_HANDLE)}) at u/proj/cache_utils.py:140  "
    "[transformers Cache.prefetch(layer_idx=3)]",
    "    fix: Call `prefetch_stream.wait_stream(torch.cuda.current_stream())` before aten::copy_ at "
    "u/proj/cache_utils.py:140 (or record an event on the default stream after aten::copy_ at "
    "u/proj/cache_utils.py:120 and make prefetch_stream wait on it).",
]


@pytest.fixture
def inner(pytester, monkeypatch):
    for o in OPTIONS.values():
        monkeypatch.delenv(o.env, raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # pytest folds summary lines to the terminal's width
    pytester.makepyfile(test_inner=INNER)
    return pytester


def run(pytester, *args):
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def block(lines: list, first: str, n: int) -> list:
    i = lines.index(first)
    return lines[i:i + n]


def test_a_racy_test_fails_with_the_paragraph_and_a_clean_one_passes(inner):
    result = run(inner, "--streamsan")
    result.assert_outcomes(passed=2, failed=1)
    lines = result.stdout.lines
    assert block(lines, PARAGRAPH[0], len(PARAGRAPH)) == PARAGRAPH
    short = "FAILED test_inner.py::test_racy - Failed: streamsan: 1 new CUDA stream race"
    assert any(line.startswith(short) for line in lines)  # pytest folds the rest by terminal width
    assert "Traceback" not in result.stdout.str()  # the paragraph alone, no traceback
    assert block(lines, "streamsan: 1 race found, 1 occurrence (1 device-device; 20 events, 3 stream ops, "
                        "3 streams).", 2)[1] == "streamsan: report written to streamsan-report.json"
    rep = json.loads((inner.path / "streamsan-report.json").read_text())
    assert [(r["kind"], r["count"], r["tests"]) for r in rep["races"]] == [
        ("device-device", 1, ["test_inner.py::test_racy"])]
    assert rep["command"][0] == "pytest" and "--streamsan" in rep["command"]
    assert rep["complete"] is True and "timeline" not in rep["races"][0]
    validator().validate(rep)


def test_without_the_option_the_plugin_does_nothing(inner):
    result = run(inner)
    result.assert_outcomes(passed=3)
    assert not (inner.path / "streamsan-report.json").exists()
    (plugins,) = [line for line in result.stdout.lines if "streamsan" in line]  # registered, silent
    assert plugins.startswith("plugins: ") and "streamsan-0.1.0" in plugins
    help_text = run(inner, "--help").stdout.str()
    assert "--streamsan " in help_text and "--streamsan-report=PATH" in help_text


def test_known_races_do_not_fail_later_tests_and_failing_tests_keep_their_error(inner):
    inner.makepyfile(test_more=textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.support import report_scenarios as S
        from test_inner import feed

        def test_same_race_again():
            feed(S.pinned_d2h_then_h2d()[len(S.prologue()):])

        def test_fails_and_races():
            feed(S.host_read_after_d2h()[len(S.prologue()):])
            assert 1 == 2, "its own failure"
    """))
    result = run(inner, "--streamsan", "test_inner.py::test_racy", "test_more.py")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert any(line.startswith("FAILED test_more.py::test_fails_and_races - AssertionError: its own")
               for line in result.stdout.lines)
    assert "- Captured streamsan call -" in out and "[1] host-device x1 on pinned-host memory" in out
    rep = json.loads((inner.path / "streamsan-report.json").read_text())
    assert [(r["kind"], r["count"], r["tests"]) for r in rep["races"]] == [
        ("device-device", 2, ["test_inner.py::test_racy", "test_more.py::test_same_race_again"]),
        ("host-device", 1, ["test_more.py::test_fails_and_races"])]


def test_pyproject_configuration_and_suppressions(inner):
    (inner.path / "pyproject.toml").write_text(
        '[tool.streamsan]\nreport = "out/combined.json"\nsuppressions = "known.supp"\n')
    (inner.path / "out").mkdir()
    (inner.path / "known.supp").write_text("frame:*/cache_utils.py:140  # the prefetch race, fixed upstream\n")
    result = run(inner, "--streamsan")
    result.assert_outcomes(passed=3)
    lines = result.stdout.lines
    assert block(lines, "streamsan: no races found (20 events, 3 stream ops, 3 streams; 1 suppressed).", 3)[1:] == [
        "streamsan: suppressed: device-device x1 at u/proj/cache_utils.py:140 by frame:*/cache_utils.py:140 "
        "(the prefetch race, fixed upstream)",
        f"streamsan: report written to {inner.path / 'out' / 'combined.json'}"]
    rep = json.loads((inner.path / "out" / "combined.json").read_text())
    assert rep["races"] == [] and rep["suppressed"][0]["tests"] == ["test_inner.py::test_racy"]
    validator().validate(rep)
    result = run(inner, "--streamsan", "--streamsan-report", "cli.json")  # the command line wins
    assert "streamsan: report written to cli.json" in result.stdout.lines


def test_a_bad_suppression_file_is_a_usage_error(inner):
    (inner.path / "bad.supp").write_text("kind:device-device\n")
    result = run(inner, "--streamsan", "--streamsan-suppressions", "bad.supp")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: streamsan: bad.supp:1: a rule needs a reason: add '# why' after 'kind:device-device'" in (
        result.stderr.lines)


def test_a_kept_trace_gives_the_report_its_timelines(inner):
    result = run(inner, "--streamsan", "--streamsan-trace", "session.sstrace")
    result.assert_outcomes(passed=2, failed=1)
    rep = json.loads((inner.path / "streamsan-report.json").read_text())
    n = len(S.prologue())
    assert rep["races"][0]["timeline"] == {"previous_seq": n + 2, "seq": n + 3, "syncs": [], "omitted": 0}
    assert (inner.path / "session.sstrace").read_bytes().startswith(b"SSTRACE1")
