"""``pytest --streamsan`` on two real torch tests (pytester, in a subprocess): a two-stream write without a
wait fails with its finding's paragraph; the same code with wait_stream passes; the combined report names the
racy test (and, with the trace kept, the syncs around the race)."""

from __future__ import annotations

import json
import os
import textwrap

import torch

from tests.support import paths

pytest_plugins = ["pytester"]

INNER = textwrap.dedent("""
    import torch


    def test_racy_two_stream_write():
        side = torch.cuda.Stream()
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
        x.fill_(1.0)  # RACY-EARLIER
        with torch.cuda.stream(side):
            x.fill_(2.0)  # RACY-LATER
        torch.cuda.synchronize()


    def test_clean_with_wait_stream():
        side = torch.cuda.Stream()
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
        x.fill_(1.0)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.fill_(2.0)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
""")


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(INNER.strip().splitlines(), 1) if marker in text)  # as makepyfile writes it


ROOT = str(paths.ROOT)


def plugin_args():
    """Load the plugin by module when this environment did not register the pytest11 entry point (an editable
    install that only put the source tree on the path)."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="pytest11")}
    return () if "streamsan" in names else ("-p", "streamsan.pytest_plugin")


def test_pytest_streamsan_fails_the_racy_test_and_passes_the_clean_one(pytester, monkeypatch):
    for key in ("REPORT", "TRACE", "SCOPE", "SUPPRESSIONS", "SESSION_DIR"):
        monkeypatch.delenv(f"STREAMSAN_{key}", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *plugin_args(), "--streamsan", "--streamsan-trace",
                                           "session.sstrace")
    result.assert_outcomes(passed=1, failed=1)
    lines = result.stdout.lines
    earlier, later = f"test_inner.py:{line_of('RACY-EARLIER')}", f"test_inner.py:{line_of('RACY-LATER')}"
    i = lines.index("streamsan: 1 new CUDA stream race during this test:")
    assert lines[i + 2].startswith("[1] device-device x1 on device memory (cuda:0) ")
    assert lines[i + 3].startswith("    earlier: write aten::fill_.Scalar on the default stream (0x0) at ")
    assert lines[i + 3].endswith(earlier)
    # (the side stream is named after the line that made it: ``side = torch.cuda.Stream()``)
    assert lines[i + 4].startswith("    later:   write aten::fill_.Scalar on side (0x") and lines[i + 4].endswith(later)
    assert lines[i + 5].startswith("    fix: Call `side.wait_stream(torch.cuda.current_stream())` before ")
    assert any(line.startswith("FAILED test_inner.py::test_racy_two_stream_write - Failed: streamsan: 1 new")
               for line in lines)
    assert "streamsan: report written to streamsan-report.json" in lines
    rep = json.loads((pytester.path / "streamsan-report.json").read_text())
    (race,) = rep["races"]
    assert (race["kind"], race["count"], race["tests"]) == ("device-device", 1,
                                                            ["test_inner.py::test_racy_two_stream_write"])
    assert race["previous_access"]["location"].endswith("/" + earlier)  # locations keep 3 path parts
    assert race["access"]["location"].endswith("/" + later)
    assert race["timeline"]["seq"] > race["timeline"]["previous_seq"]
    assert rep["environment"]["torch"] == torch.__version__
