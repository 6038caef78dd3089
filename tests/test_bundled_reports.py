"""The bundled example: the transformers offloaded-cache race recorded on an H200, replayed without a GPU."""

import json
from pathlib import Path

import jsonschema

from streamsan.replay import replay_trace

REPORTS = Path(__file__).parent.parent / "reports"
SCHEMA = json.loads((REPORTS.parent / "streamsan" / "report" / "schema.json").read_text())


def hazards(report):
    return sorted((r["kind"], r["memory"]["label"], r["previous_access"]["agent"]["role"],
                   r["previous_access"]["op"], r["previous_access"]["location"], r["access"]["agent"]["role"],
                   r["access"]["op"], r["access"]["location"]) for r in report["races"])


EXPECTED = sorted([
    ("device-device", "cache.layers[0].keys", "default", "aten::_to_copy", "transformers/cache_utils.py:79",
     "prefetch_stream", "aten::_to_copy", "transformers/cache_utils.py:85"),
    ("device-device", "cache.layers[0].values", "default", "aten::_to_copy", "transformers/cache_utils.py:80",
     "prefetch_stream", "aten::_to_copy", "transformers/cache_utils.py:86"),
    ("missing-record-stream", "cache.layers[0].keys", "default", "aten::cat", "transformers/cache_utils.py:146",
     "prefetch_stream", "allocation", "transformers/cache_utils.py:85"),
    ("missing-record-stream", "cache.layers[0].values", "default", "aten::cat", "transformers/cache_utils.py:147",
     "prefetch_stream", "allocation", "transformers/cache_utils.py:85"),
])


def test_replay_of_the_bundled_trace_finds_both_hazards_with_labels():
    report = replay_trace(str(REPORTS / "transformers-48947.sstrace"))
    jsonschema.validate(report, SCHEMA)
    assert hazards(report) == EXPECTED
    by_kind = {r["kind"]: r for r in report["races"]}
    assert by_kind["device-device"]["memory"]["space"] == "pinned-host"
    assert "prefetch_stream.wait_stream(torch.cuda.current_stream())" in by_kind["device-device"]["fix"]
    assert "record_stream(torch.cuda.current_stream())" in by_kind["missing-record-stream"]["fix"]
    assert by_kind["device-device"]["access"]["context"].startswith("transformers Cache.update(")


def test_bundled_report_is_the_full_run_and_valid():
    report = json.loads((REPORTS / "transformers-48947.json").read_text())
    jsonschema.validate(report, SCHEMA)
    assert sorted(r["kind"] for r in report["races"]) == ["device-device", "device-device",
                                                          "missing-record-stream", "missing-record-stream"]
    assert all(r["count"] > 20 for r in report["races"])  # 8 layers x 4 steps: one finding per code location
    assert report["environment"]["gpus"] and "H200" in report["environment"]["gpus"][0]
