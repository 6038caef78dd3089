"""The text and Markdown renderers read only a report dict."""

from __future__ import annotations

import json

from streamsan.report.build import build_report
from streamsan.report.render_markdown import render_markdown
from streamsan.report.render_text import render_text
from tests.support import report_scenarios as S

ENV = {"streamsan": "0.1.0", "torch": "2.11.0", "cuda_runtime": "12.8", "nvidia_driver": None,
       "gpus": ["NVIDIA H200"], "command": ["python", "run.py"]}


def report_of(events, **kw):
    rep = build_report(S.analyze(events), command=["python", "run.py"], environment=ENV, **kw)
    return json.loads(json.dumps(rep))  # renderers see what a file holds


def test_text_one_paragraph_per_finding():
    rep = report_of(S.pinned_d2h_then_h2d(3) + S.host_read_after_d2h()[len(S.prologue()):])
    out = render_text(rep)
    first, *rest = out.splitlines()
    assert first.startswith("streamsan: 2 races found, 4 occurrences (1 device-device, 1 host-device;")
    paragraphs = out.strip().split("\n\n")[1:]
    assert len(paragraphs) == 2
    dd = paragraphs[0]
    assert dd.startswith("[1] device-device x3 on pinned-host memory 0x1000-0x2000 (4096 bytes, "
                         "cache.layers[3].keys, bfloat16[1, 8, 2, 128])")
    assert "earlier: write aten::copy_ on the default stream (0x0) at u/proj/cache_utils.py:120" in dd
    assert f"later:   read aten::copy_ on prefetch_stream ({hex(S.PREFETCH_HANDLE)}) at " \
           "u/proj/cache_utils.py:140  [transformers Cache.prefetch(layer_idx=3)]" in dd
    assert "fix: Call `prefetch_stream.wait_stream(torch.cuda.current_stream())`" in dd
    assert "read aten::sum on the host at u/proj/run.py:9" in paragraphs[1]
    assert "torch.cuda.current_stream().synchronize()" in paragraphs[1]


def test_text_missing_record_stream_names_the_allocation():
    out = render_text(report_of(S.missing_record_stream()))
    assert "later:   allocation on prefetch_stream" in out
    assert "record_stream(torch.cuda.current_stream())" in out


def test_text_no_races_incomplete_and_notes():
    rep = report_of(S.prologue(), complete=False, problems=["t.sstrace: truncated frame after 7 events"])
    rep["notes"] = [{"level": "warning", "text": "a CUDA graph replay was not analyzed"}]
    out = render_text(rep)
    n = len(S.prologue())
    assert out.splitlines()[0] == f"streamsan: no races found ({n} events, 0 stream ops, 3 streams)."
    assert "streamsan: warning: the report is incomplete: t.sstrace: truncated frame after 7 events" in out
    assert "streamsan: warning: a CUDA graph replay was not analyzed" in out


def test_markdown_is_a_bug_tracker_comment():
    rep = report_of(S.pinned_d2h_then_h2d(2))
    md = render_markdown(rep)
    assert md.startswith("## streamsan: 1 CUDA stream race found\n")
    assert "| # | Kind | Later access | Earlier access | Memory | Count |" in md
    assert "| 1 | device-device | read `aten::copy_` on prefetch_stream at `u/proj/cache_utils.py:140` |" in md
    assert "### 1. device-device" in md
    assert md.count("<details>") == 3  # two stacks and the environment
    assert "<summary>Stack of the later access: read aten::copy_ at u/proj/cache_utils.py:140</summary>" in md
    assert f'  File "{S.CACHE}", line 140, in prefetch' in md
    assert f'  File "{S.CACHE}", line 120, in offload' in md
    assert "(1 library frame hidden)" in md
    assert "- **Fix:** Call `prefetch_stream.wait_stream(torch.cuda.current_stream())`" in md
    assert "- **Missing edge:**" in md
    assert "label `cache.layers[3].keys`" in md
    assert "| gpus | `NVIDIA H200` |" in md and "| nvidia_driver | unknown |" in md
    assert "| command | `python run.py` |" in md
    assert "transformers Cache.offload(layer_idx=3)" in md


def test_markdown_escapes_table_cells_and_html():
    rep = report_of(S.alloc_reuse())
    rep["races"][0]["access"]["op"] = "a|b"
    rep["races"][0]["access"]["context"] = "<script>"
    md = render_markdown(rep)
    assert "`a\\|b`" in md
    assert "<script>" not in md and "&lt;script&gt;" in md


def test_markdown_no_races_and_incomplete():
    md = render_markdown(report_of(S.prologue(), complete=False, problems=["crashed"]))
    assert md.startswith("## streamsan: no races found")
    assert "> **Incomplete:** crashed" in md
    assert "| # |" not in md
