"""The same programs under PyTorch's CUDA allocator configurations (tests/gpu/memory/alloc_backend_programs.py, one
child process each): the native caching allocator, with expandable segments, the cudaMallocAsync backend and a program's
own stream-ordered allocator (stream_ordered_alloc.c), the last two reporting no allocations or frees (streamsan
declares each op's new outputs and learns their frees from their storages, docs/semantics.md); and every scenario
table of tests/gpu under cudaMallocAsync."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).with_name("alloc_backend_programs.py")
MRS = ["missing-record-stream", "aten::mul.Tensor", "allocation"]
RACE = ["device-device", "aten::fill_.Scalar", "aten::fill_.Scalar"]
REUSE = ["alloc-reuse", "aten::fill_.Scalar", "aten::fill_.Scalar"]
# program -> findings, per configuration (a program left out of one is not compared there: with expandable segments
# the caching allocator need not hand x's block to z in alloc_reuse_on_other_stream)
EXPECTED = {
    "": {"churn_across_streams": [], "missing_record_stream": [MRS], "record_stream_right": [],
         "write_default_then_side_write": [RACE], "alloc_reuse_on_other_stream": [REUSE]},
    "expandable_segments:True": {"churn_across_streams": [], "missing_record_stream": [MRS],
                                 "record_stream_right": [], "write_default_then_side_write": [RACE]},
    # the default stream's unrecorded read is found at the side stream's next allocation of the freed memory, as
    # with the native allocator; the side stream writes z, allocated on the default stream, without waiting for
    # that allocation
    "backend:cudaMallocAsync": {"churn_across_streams": [], "missing_record_stream": [MRS],
                                "record_stream_right": [], "write_default_then_side_write": [RACE],
                                "alloc_reuse_on_other_stream": [["device-device", "allocation", "aten::fill_.Scalar"]]},
}


# A program's own allocator (torch.cuda.memory.change_current_allocator, stream_ordered_alloc.c: stream-ordered, as
# RMM's asynchronous resource) is a stream-ordered allocator PyTorch's GPU trace hears nothing from: the same findings
PLUGGABLE = "pluggable"
EXPECTED[PLUGGABLE] = EXPECTED["backend:cudaMallocAsync"]
BACKEND = {"": "native", "expandable_segments:True": "native", "backend:cudaMallocAsync": "cudaMallocAsync",
           PLUGGABLE: "pluggable"}


def _allocator_library(tmp_path) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler for the test allocator")
    so = tmp_path / "stream_ordered_alloc.so"
    src = Path(__file__).with_name("stream_ordered_alloc.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(so), str(src), "-ldl"], check=True, capture_output=True,
                   timeout=60)
    return str(so)


@pytest.mark.parametrize("conf", list(EXPECTED), ids=lambda c: c or "native")
def test_findings_under_each_allocator(conf, tmp_path):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="" if conf == PLUGGABLE else conf)
    env.pop("STREAMSAN_RECORD_DIR", None)
    if conf == PLUGGABLE:
        env["STREAMSAN_TEST_ALLOCATOR"] = _allocator_library(tmp_path)
    out = subprocess.run([sys.executable, str(PROGRAMS)], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    unreported = BACKEND[conf] != "native"
    assert got["backend"] == BACKEND[conf]
    assert {k: v["findings"] for k, v in got["programs"].items() if k in EXPECTED[conf]} == EXPECTED[conf]
    frees = {k: v["frees"] for k, v in got["programs"].items()}
    allocs = {k: v["allocs"] for k, v in got["programs"].items()}
    # declared by the tracer where the allocator is silent: allocations from the ops' outputs, frees from the deaths
    # of their storages
    assert all(n > 0 for n in allocs.values()), allocs
    assert all(n > 0 for n in frees.values()), frees
    assert bool(got["notes"]) == unreported


# Every scenario table, with its module's UNDER_CUDA_MALLOC_ASYNC exceptions (scenario_kit.scenario_tests).
GPU_TESTS = Path(__file__).resolve().parents[1]
TABLES = sorted(p.relative_to(GPU_TESTS).as_posix() for p in GPU_TESTS.rglob("test_*.py")
                if "scenario_tests(" in p.read_text() and p.name != Path(__file__).name)


def test_every_scenario_table_under_cuda_malloc_async():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    env.pop("STREAMSAN_RECORD_DIR", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-rf",
                          *[str(GPU_TESTS / t) for t in TABLES]], env=env, capture_output=True, text=True,
                         timeout=600, cwd=GPU_TESTS.parents[1])
    assert len(TABLES) >= 15, TABLES
    assert out.returncode == 0, out.stdout[-6000:]
