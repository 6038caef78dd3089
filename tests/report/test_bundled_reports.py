"""The bundled example: the transformers offloaded-cache race recorded on an H200, replayed without a GPU. The
bundled report and its Markdown are the replay of the bundled trace, of the script in examples/."""

import json
import re

import jsonschema

from streamsan.replay import replay_trace
from streamsan.report.render_markdown import render_markdown
from tests.support.paths import ROOT

REPORTS = ROOT / "reports"
SCHEMA = json.loads((ROOT / "streamsan" / "report" / "schema.json").read_text())


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


def replayed():
    return replay_trace(str(REPORTS / "transformers-48947.sstrace"))


def test_replay_of_the_bundled_trace_finds_both_hazards_with_labels():
    report = replayed()
    jsonschema.validate(report, SCHEMA)
    assert hazards(report) == EXPECTED
    by_kind = {r["kind"]: r for r in report["races"]}
    assert by_kind["device-device"]["memory"]["space"] == "pinned-host"
    assert "prefetch_stream.wait_stream(torch.cuda.current_stream())" in by_kind["device-device"]["fix"]
    assert "record_stream(torch.cuda.current_stream())" in by_kind["missing-record-stream"]["fix"]
    assert by_kind["device-device"]["access"]["context"].startswith("transformers Cache.update(")


def test_the_bundled_report_is_the_replay_of_the_bundled_trace():
    bundled = json.loads((REPORTS / "transformers-48947.json").read_text())
    jsonschema.validate(bundled, SCHEMA)
    report = replayed()
    assert [(r["fingerprint"], r["count"], r["memory"]["start"]) for r in bundled["races"]] == [
        (r["fingerprint"], r["count"], r["memory"]["start"]) for r in report["races"]]
    assert bundled["summary"] == report["summary"] and bundled["command"] == report["command"]
    assert bundled["environment"]["gpus"] and "H200" in bundled["environment"]["gpus"][0]


def test_the_bundled_command_is_the_example_in_the_repository():
    script = json.loads((REPORTS / "transformers-48947.json").read_text())["command"][1]
    assert script == "examples/transformers_offloaded_cache.py" and (ROOT / script).is_file()


def test_the_markdown_and_the_texts_say_the_same_count_of_findings():
    bundled = json.loads((REPORTS / "transformers-48947.json").read_text())
    md = (REPORTS / "transformers-48947.md").read_text()
    assert md == render_markdown(bundled)
    assert md.startswith("## streamsan: 4 CUDA stream races found\n")
    for text in ((REPORTS / "README.md").read_text(), (ROOT / "examples" / "transformers_offloaded_cache.py").read_text()):
        assert re.search(r"\b4 findings\b", " ".join(text.split())), text[:200]
        assert "two stream hazards" not in text
