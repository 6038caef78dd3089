"""The offloaded-cache race of transformers 5.17 (DynamicCache(offloading=True)), end to end through `streamsan wrap`, on a GPU with transformers 5.x.

Expected line numbers are read from the installed transformers source, so the test names the exact code
locations without hard-coding one release's numbering.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.support import paths

transformers = pytest.importorskip("transformers")

from tests.gpu.support.transformers_lines import CAT_K, CAT_V, OFFLOAD_K, OFFLOAD_V, PREFETCH_K, PREFETCH_V  # noqa: E402

ROOT = str(paths.ROOT)
EXAMPLE = os.path.join(ROOT, "examples", "transformers_offloaded_cache.py")


def wrap(tmp_path, *args, scope="full"):
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "streamsan", "wrap", "--scope", scope, "--report", str(report), "--",
           sys.executable, EXAMPLE, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(report.read_text()), r


def summary(report):
    return sorted((x["kind"], x["previous_access"]["agent"]["role"], x["previous_access"]["op"],
                   x["previous_access"]["location"], x["access"]["agent"]["role"], x["access"]["op"],
                   x["access"]["location"]) for x in report["races"])


@pytest.mark.parametrize("model, scope", [("qwen3", "full"), ("qwen3_next", "full"), ("qwen3", "hooks")])
def test_offloaded_cache_both_hazards_idle_gpu(tmp_path, model, scope):
    report, run = wrap(tmp_path, "--model", model, scope=scope)
    assert "argmax match: True" in run.stdout  # the GPU was idle: outputs happen to be right
    assert summary(report) == sorted([
        ("device-device", "default", "aten::_to_copy", OFFLOAD_K, "prefetch_stream", "aten::_to_copy", PREFETCH_K),
        ("device-device", "default", "aten::_to_copy", OFFLOAD_V, "prefetch_stream", "aten::_to_copy", PREFETCH_V),
        ("missing-record-stream", "default", "aten::cat", CAT_K, "prefetch_stream", "allocation", PREFETCH_K),
        ("missing-record-stream", "default", "aten::cat", CAT_V, "prefetch_stream", "allocation", PREFETCH_K),
    ])
    for race in report["races"]:
        assert race["count"] > 1  # one finding per code location, counted over layers and steps
        assert race["memory"]["label"].startswith("cache.layers[")
        assert race["memory"]["space"] == ("pinned-host" if race["kind"] == "device-device" else "device")
        assert "prefetch_stream" in race["fix"]
        assert race["previous_access"]["context"].startswith("transformers Cache.")


@pytest.mark.parametrize("model", ["qwen3", "qwen3_next"])
def test_offloaded_cache_fixed_is_clean(tmp_path, model):
    report, _ = wrap(tmp_path, "--model", model, "--fixed")
    assert report["races"] == []
