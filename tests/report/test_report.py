"""JSON report v1: building from hand-made event sequences, the schema, merging, the environment."""

from __future__ import annotations

import json
import sys
import types

import pytest

from streamsan import events as E
from streamsan.report.build import SCHEMA
from streamsan.report.environment import collect_environment
from streamsan.report.merge import merge_reports
from tests.support import report_scenarios as S
from tests.support.paths import ROOT
from tests.support.report_kit import ENV, report_of, validator

def only_race(report):
    assert len(report["races"]) == 1, [r["kind"] for r in report["races"]]
    return report["races"][0]


# ---------------------------------------------------------------- building
def test_device_device_on_pinned_memory():
    rep = report_of(S.pinned_d2h_then_h2d())
    r = only_race(rep)
    assert r["kind"] == "device-device" and r["count"] == 1 and len(r["fingerprint"]) == 16
    assert r["memory"] == {"space": "pinned-host", "device": None, "start": "0x1000", "end": "0x2000",
                           "bytes": 4096, "what": S.WHAT, "label": "cache.layers[3].keys"}
    cur, prev = r["access"], r["previous_access"]
    assert cur["agent"] == {"kind": "stream", "stream": hex(S.PREFETCH_HANDLE), "device": 0,
                            "role": "prefetch_stream"}
    assert prev["agent"] == {"kind": "stream", "stream": "0x0", "device": 0, "role": "default"}
    assert (prev["type"], prev["op"], prev["location"]) == ("write", "aten::copy_", "u/proj/cache_utils.py:120")
    assert (cur["type"], cur["op"], cur["location"]) == ("read", "aten::copy_", "u/proj/cache_utils.py:140")
    assert prev["context"] == "transformers Cache.offload(layer_idx=3)"
    assert cur["context"] == "transformers Cache.prefetch(layer_idx=3)"
    # stacks trimmed to user code, the full one kept
    assert [f["file"] for f in cur["stack"]] == [S.CACHE, S.MAIN]
    assert [f["file"] for f in cur["stack_full"]] == [S.TORCH, S.CACHE, S.MAIN]
    assert cur["stack"][0] == {"file": S.CACHE, "line": 140, "function": "prefetch"}
    assert r["allocation"]["site"]["owner"]["kind"] == "host"
    assert r["allocation"]["site"]["location"] == "u/proj/cache_utils.py:118"
    assert r["allocation"]["previous_life"] is None and r["allocation"]["reused"] is False
    assert "prefetch_stream.wait_stream(torch.cuda.current_stream())" in r["fix"]
    assert "before aten::copy_ at u/proj/cache_utils.py:140" in r["fix"]
    assert "prefetch_stream" in r["missing_edge"] and "the default stream" in r["missing_edge"]


def test_loop_iterations_are_one_finding_with_a_count():
    r = only_race(report_of(S.pinned_d2h_then_h2d(iterations=3)))
    assert r["count"] == 3
    assert r["fingerprint"] == only_race(report_of(S.pinned_d2h_then_h2d()))["fingerprint"]


def test_host_device_fix_synchronizes_the_stream_before_the_host_access():
    r = only_race(report_of(S.host_read_after_d2h()))
    assert r["kind"] == "host-device"
    assert r["access"]["agent"] == {"kind": "host", "stream": None, "device": None, "role": "host"}
    assert r["access"]["type"] == "read" and r["access"]["location"] == "u/proj/run.py:9"
    assert "`torch.cuda.current_stream().synchronize()`" in r["fix"]
    assert "before the host read at u/proj/run.py:9" in r["fix"]
    assert report_of(S.host_read_after_d2h(synchronized=True))["races"] == []


def test_missing_record_stream():
    r = only_race(report_of(S.missing_record_stream()))
    assert r["kind"] == "missing-record-stream"
    assert r["previous_access"]["op"] == "aten::cat" and r["previous_access"]["agent"]["role"] == "default"
    assert r["access"]["op"] == "allocation" and r["access"]["agent"]["role"] == "prefetch_stream"
    assert r["memory"]["space"] == "device" and r["memory"]["device"] == 0
    assert r["memory"]["label"] == "cache.layers[3].keys"
    alloc = r["allocation"]
    assert alloc["reused"] is True
    assert alloc["previous_life"]["location"] == "u/proj/cache_utils.py:138"
    assert alloc["previous_life"]["owner"]["role"] == "prefetch_stream"
    assert "`cache.layers[3].keys.record_stream(torch.cuda.current_stream())`" in r["fix"]
    assert "after the use at u/proj/cache_utils.py:160" in r["fix"]
    assert "`prefetch_stream.wait_stream(torch.cuda.current_stream())`" in r["fix"]
    assert "did on this run" in r["missing_edge"]


def test_alloc_reuse_names_the_earlier_lifes_stream_and_an_unnamed_stream():
    r = only_race(report_of(S.alloc_reuse()))
    assert r["kind"] == "alloc-reuse"
    assert r["access"]["agent"]["role"] is None and r["access"]["agent"]["stream"] == hex(S.SIDE_HANDLE)
    assert r["allocation"]["reused"] is True
    assert r["allocation"]["previous_life"]["location"] == "u/proj/cache_utils.py:160"
    assert r["allocation"]["site"]["what"] == "float32[1024]"
    assert "`tensor.record_stream(prefetch_stream)`" in r["fix"]
    assert f"`<stream {hex(S.SIDE_HANDLE)}>.wait_stream(prefetch_stream)`" in r["fix"]


def test_alloc_reuse_by_the_owner_stream_fixes_with_a_wait_not_record_stream():
    r = only_race(report_of(S.alloc_reuse_by_owner()))
    assert (r["kind"], r["previous_access"]["agent"]["role"]) == ("alloc-reuse", "default")
    assert r["fix"] == (f"Call `<stream {hex(S.SIDE_HANDLE)}>.wait_stream(torch.cuda.current_stream())` before "
                        f"aten::fill_ at {r['access']['location']}.")
    assert "record_stream" not in r["fix"]
    assert "the new tensor was allocated on the default stream" in r["missing_edge"]


def test_top_level_and_summary():
    events = S.missing_record_stream() + [E.note("warning", "a CUDA graph was not analyzed")]
    rep = report_of(events, complete=False, problems=["trace.sstrace: truncated frame"])
    assert rep["schema"] == SCHEMA == "streamsan.report/1"
    assert rep["command"] == ["python", "run.py"] and rep["environment"] == ENV
    assert rep["complete"] is False and rep["problems"] == ["trace.sstrace: truncated frame"]
    assert rep["notes"] == [{"level": "warning", "text": "a CUDA graph was not analyzed"}]
    s = rep["summary"]
    assert s["races"] == 1 and s["occurrences"] == 1
    assert s["by_kind"] == {"device-device": 0, "host-device": 0, "alloc-reuse": 0, "missing-record-stream": 1}
    assert s["events"] == len(events) and s["streams"] == 3 and s["ops"] == 3
    assert s["allocs"] == 2 and s["frees"] == 1
    assert "processes" not in rep


def test_process_entry():
    rep = report_of(S.pinned_d2h_then_h2d(2), process={"pid": 42, "trace": "trace-42.sstrace"})
    (p,) = rep["processes"]
    assert p["pid"] == 42 and p["trace"] == "trace-42.sstrace"
    assert p["complete"] is True and p["races"] == 1 and p["occurrences"] == 2 and p["events"] > 0


# ---------------------------------------------------------------- schema
ALL_SCENARIOS = [S.pinned_d2h_then_h2d, S.host_read_after_d2h, S.missing_record_stream, S.alloc_reuse]


@pytest.mark.parametrize("scenario", ALL_SCENARIOS, ids=lambda f: f.__name__)
def test_reports_validate_against_the_schema(scenario):
    v = validator()
    rep = report_of(scenario())
    v.validate(rep)
    v.validate(json.loads(json.dumps(rep)))


def test_merged_and_empty_reports_validate():
    v = validator()
    reports = [report_of(f(), process={"pid": i}) for i, f in enumerate(ALL_SCENARIOS)]
    v.validate(merge_reports(reports))
    v.validate(report_of(S.prologue()))
    v.validate(merge_reports([], command=["x"], environment={}))


def test_schema_rejects_a_wrong_version_and_a_missing_key():
    v = validator()
    rep = report_of(S.pinned_d2h_then_h2d())
    assert not v.is_valid(dict(rep, schema="streamsan.report/2"))
    bad = json.loads(json.dumps(rep))
    del bad["races"][0]["fix"]
    assert not v.is_valid(bad)


def test_the_schema_is_one_file_in_the_package():
    outside = {".git", "build", "dist", ".gpu", ".venv"}  # version control and build outputs are not the repository's files
    found = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("schema.json")
                   if not outside & set(p.relative_to(ROOT).parts))
    assert found == ["streamsan/report/schema.json"]


# ---------------------------------------------------------------- merge
def test_merge_dedups_by_fingerprint_and_sums_counts():
    a = report_of(S.pinned_d2h_then_h2d(2), process={"pid": 1})
    b = report_of(S.pinned_d2h_then_h2d(3) + [E.note("warning", "w")], process={"pid": 2})
    c = report_of(S.host_read_after_d2h(), complete=False, problems=["c: truncated frame"], process={"pid": 3})
    m = merge_reports([a, b, c], command=["torchrun", "x.py"])
    assert [r["kind"] for r in m["races"]] == ["device-device", "host-device"]
    assert m["races"][0]["count"] == 5
    assert a["races"][0]["count"] == 2  # inputs untouched
    assert [p["pid"] for p in m["processes"]] == [1, 2, 3]
    assert m["complete"] is False and m["problems"] == ["c: truncated frame"]
    assert m["notes"] == [{"level": "warning", "text": "w"}]
    assert m["command"] == ["torchrun", "x.py"] and m["environment"] == ENV
    s = m["summary"]
    assert s["races"] == 2 and s["occurrences"] == 6 and s["processes"] == 3
    assert s["by_kind"]["device-device"] == 1 and s["by_kind"]["host-device"] == 1
    assert s["events"] == sum(r["summary"]["events"] for r in (a, b, c))


def test_merge_of_reports_without_processes_synthesizes_entries():
    m = merge_reports([report_of(S.alloc_reuse()), report_of(S.alloc_reuse())])
    assert len(m["processes"]) == 2 and m["processes"][0]["pid"] is None
    assert m["races"][0]["count"] == 2


# ---------------------------------------------------------------- environment
def test_environment_without_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # "not installed"
    env = collect_environment()
    assert "command" not in env  # (the report has it once, as its own "command")
    assert env["python"].startswith(".".join(map(str, sys.version_info[:2])))
    assert env["nvidia_driver"] is None and env["gpus"] == []
    for key in ("streamsan", "platform", "torch", "cuda_runtime", "tracer", "cupy", "transformers"):
        assert key in env
    json.dumps(env)


def test_environment_says_which_torch_tracer_runs(monkeypatch):
    from streamsan.report.environment import tracer_core

    monkeypatch.setenv("STREAMSAN_CORE", "python")
    assert collect_environment()["tracer"] == "python (STREAMSAN_CORE=python)"
    monkeypatch.delenv("STREAMSAN_CORE")
    try:
        from streamsan import _ctracer
    except ImportError:
        assert tracer_core() == "python (the C tracer was not built: no C compiler at install)"
    else:
        if not _ctracer.AVAILABLE:
            assert tracer_core() == "python (the C tracer needs Python 3.11 or later)"
        else:
            from streamsan.tracers.torch import lane

            monkeypatch.setattr(lane, "_last_reason", lane.NOT_STARTED)
            assert tracer_core() == "c"
            monkeypatch.setattr(lane, "_last_reason", "")  # the last tracer ran with the dispatch lane
            assert tracer_core() == "native"
            monkeypatch.setattr(lane, "_last_reason", "STREAMSAN_CORE=c")
            assert tracer_core() == "c (the dispatch lane is off: STREAMSAN_CORE=c)"
    import streamsan

    monkeypatch.setitem(sys.modules, "streamsan._ctracer", None)  # as if it was not built
    monkeypatch.delattr(streamsan, "_ctracer", raising=False)
    assert tracer_core() == "python (the C tracer was not built: no C compiler at install)"


def test_environment_says_the_python_tracer_runs_under_cuda_malloc_async(monkeypatch):
    pytest.importorskip("torch")
    from streamsan.report.environment import tracer_core
    from streamsan.tracers.torch.allocators import ALLOCATOR

    monkeypatch.delenv("STREAMSAN_CORE", raising=False)
    monkeypatch.setattr(ALLOCATOR, "unreported", True)
    monkeypatch.setattr(ALLOCATOR, "name", "cudaMallocAsync")
    assert tracer_core() == "python (PyTorch's cudaMallocAsync CUDA allocator: the tracer declares allocations)"


def test_environment_reads_nvml(monkeypatch):
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"580.65.06", nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: ["NVIDIA H200", b"NVIDIA H100"][h])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    env = collect_environment()
    assert env["nvidia_driver"] == "580.65.06" and env["gpus"] == ["NVIDIA H200", "NVIDIA H100"]


def test_environment_survives_a_failing_nvml(monkeypatch):
    def boom():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=boom))
    env = collect_environment()
    assert env["nvidia_driver"] is None and env["gpus"] == []


def test_environment_reports_only_imported_cupy_and_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5.17.0"))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    env = collect_environment()
    assert env["transformers"] == "5.17.0" and env["cupy"] is None


@pytest.mark.parametrize("role, code", [
    ("prefetch_stream", "prefetch_stream"),
    ("self.copy_stream", "self.copy_stream"),
    ("default", "torch.cuda.current_stream()"),
    ("self.streams#2", "<self.streams#2>"),  # (the second of streams made on one line)
    ("graph capture stream", "<graph capture stream>"),
    (None, "<stream 0x5a>"),
])
def test_a_fix_spells_a_stream_as_code_only_where_its_name_is_code(role, code):
    from streamsan.report.advice import stream_code

    assert stream_code({"kind": "stream", "stream": "0x5a", "role": role}) == code


def test_a_trace_whose_tracer_stopped_replays_as_incomplete():
    """A tracer's note that it stopped on a bug of its own (in a trace a process of ``streamsan wrap`` left): the
    report of those events is incomplete, and its problems say why."""
    from streamsan import events as E
    from streamsan.analysis.analyzer import Analyzer
    from streamsan.report.build import build_report

    text = f"{E.TRACING_STOPPED} at aten.copy_.default (ValueError: x); findings cover what ran before it"
    a = Analyzer()
    a.feed([E.note("warning", text)])
    a.finish()
    rep = build_report(a, command=["python", "train.py"], environment={})
    assert rep["complete"] is False and rep["problems"] == [text]
    assert build_report(Analyzer(), command=["python"], environment={})["complete"] is True
