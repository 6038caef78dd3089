"""Replay traces recorded on an H200 by tests/gpu/: the same exact findings.

One folder per suite under ``tests/replay/fixtures/``, its ``expected.json`` beside its traces (name -> findings,
as (kind, previous stream role, previous op, current stream role, current op)); every trace must have an
expectation and give exactly it. The suites:

- ``torch_scenarios``, ``cupy_scenarios``: the scenarios of tests/gpu/torch/test_torch_scenarios.py and
  tests/gpu/cupy/test_cupy_scenarios.py (which read their expectations from here);
- ``collectives_devices_threads_triton``: NCCL collectives (tests/gpu/torch/test_collectives.py), copies between two
  GPUs (test_multi_gpu.py), loader threads and a CUDA graph (test_reliability.py), Triton kernels
  (test_triton_kernels.py);
- ``real_world_programs``: stream bugs of real projects and their fixes (tests/gpu/projects/, the CuPy ones of
  tests/gpu/cupy/, tests/gpu/graphs/test_cuda_graphs.py), the precision probes of views, rows and the allocator
  (tests/gpu/memory/), real transformers paths (``transformers-*``, tests/gpu/transformers/test_transformers_paths.py:
  generate with each cache, streamers, host copies), backward passes on streams
  (tests/gpu/torch/test_autograd_streams.py) and training steps of DDP, FSDP (both APIs), tensor parallelism,
  activation checkpointing and AMP (tests/gpu/libraries/test_parallel_libs.py: all clean);
- ``bench_decode``: one whole run of the benchmark's decode loop (bench/bench.py: an 8-layer Qwen3, 512-token prompt,
  32 steps; about 50k events each), resident (clean) and with ``DynamicCache(offloading=True)`` (transformers 5.17's
  offloading bug);
- ``cuda_malloc_async``: the torch scenarios and the allocator, training, inference, serving and thread/event
  programs under PyTorch's cudaMallocAsync allocator, which reports no allocations or frees (the tracer declares
  them): the native allocator's findings, but for the one exception of test_torch_scenarios.py's
  UNDER_CUDA_MALLOC_ASYNC and the known false report of tests/gpu/projects/test_inference.py;
- ``independent_programs`` (``<area>-<program>``): the independent programs of
  tests/gpu/programs/test_independent_programs.py, stream bugs of real projects and their fixes written by authors
  who had not read streamsan.

The traces are real PyTorch programs (torch 2.11, CUDA 13); CI has no GPU, so this is how it checks the whole
path from a live program's events to findings.
"""

import json
import pytest

from streamsan.replay import replay_trace
from tests.support.fixtures import FIXTURES, expected, suites, trace, traces
from tests.support.paths import ROOT

EXPECTED = {f"{suite}/{name}": findings for suite in suites() for name, findings in expected(suite).items()}


def summarize(report):
    return [[r["kind"], r["previous_access"]["agent"]["role"], r["previous_access"]["op"],
             r["access"]["agent"]["role"], r["access"]["op"]] for r in report["races"]]


def test_every_expectation_has_a_trace():
    assert sorted(f"{p.parent.name}/{p.stem}" for p in FIXTURES.rglob("*.sstrace")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_replayed_scenario(name):
    report = replay_trace(str(trace(name)))
    assert report["complete"] is True
    assert summarize(report) == EXPECTED[name]


def test_a_whole_offloaded_decode_run_gives_the_bug_once_per_pair_of_call_sites():
    """The benchmark's offloading decode loop, one whole run: transformers 5.17's bug as the reference repro
    reports it (reports/transformers-48947.json), each finding once with every occurrence counted (one per layer
    and step after the first), labelled with the first cache layer it was met on."""
    report = replay_trace(str(trace("bench_decode/decode_qwen3_offloading")))
    got = [(r["kind"], r["count"], r["memory"]["space"], r["memory"]["label"], r["previous_access"]["location"],
            r["access"]["location"]) for r in report["races"]]
    assert got == [
        ("device-device", 257, "pinned-host", "cache.layers[0].keys", "transformers/cache_utils.py:79",
         "transformers/cache_utils.py:85"),
        ("device-device", 257, "pinned-host", "cache.layers[0].values", "transformers/cache_utils.py:80",
         "transformers/cache_utils.py:86"),
        ("missing-record-stream", 255, "device", "cache.layers[0].keys", "transformers/cache_utils.py:146",
         "transformers/cache_utils.py:85"),
        ("missing-record-stream", 255, "device", "cache.layers[0].values", "transformers/cache_utils.py:147",
         "transformers/cache_utils.py:85"),
    ]
    assert report["summary"]["events"] == 54257 and report["summary"]["streams"] == 2
    bundled = json.loads((ROOT / "reports" / "transformers-48947.json").read_text())
    assert [r[0] for r in got] == [r["kind"] for r in bundled["races"]]
    clean = replay_trace(str(trace("bench_decode/decode_qwen3")))
    assert clean["races"] == [] and clean["summary"]["ops"] == 15510 and clean["complete"] is True


def test_a_replayed_cuda_graph_says_how_replays_are_checked():
    report = replay_trace(str(trace("collectives_devices_threads_triton/cuda_graph_replay_after_wait_stream")))
    assert [n["text"] for n in report["notes"]] == [
        "CUDA graphs: a replay is checked as one access, on the stream it runs on, of the memory its captured aten "
        "ops touch; kernels captured outside aten ops (Triton, native extensions) and races inside a graph are not "
        "analyzed"]
    assert report["races"] == []


@pytest.mark.parametrize("name", ["torch_scenarios/missing_record_stream",
                                  "collectives_devices_threads_triton/collective-async_allreduce_then_use"])
def test_uncompressed_frames_replay_the_same(name, tmp_path):
    """A trace written with uncompressed frames (as under ``streamsan wrap``) replays to the same findings."""
    from streamsan.trace import TraceReader, TraceWriter

    r = TraceReader(str(trace(name)))
    w = TraceWriter(str(tmp_path / "raw.sstrace"), r.header, compress=False)
    for batch in r.batches():
        w.write(batch)
    w.close(r.footer)
    report = replay_trace(str(tmp_path / "raw.sstrace"))
    assert report["complete"] is True
    assert summarize(report) == EXPECTED[name]



def test_the_engines_gradient_records_keep_fsdp_clean():
    """FSDP1 on an H200: the autograd engine hands gradients from the default stream to the stream FSDP unsharded
    on and records them there in C++; the tracer writes those records as RECORD_STREAM events with the backward
    node's stack. Without them the trace would give a false missing-record-stream."""
    from streamsan import events as E
    from streamsan.analysis.analyzer import Analyzer
    from streamsan.trace import TraceReader

    engine_stacks, dropped, stripped = set(), 0, Analyzer()
    for batch in TraceReader(str(trace("real_world_programs/fsdp1_training"))).batches():
        kept = []
        for ev in batch:
            if ev[0] == E.DEF_STACK and ev[2] and ev[2][0][0] == "<autograd engine>":
                engine_stacks.add(ev[1])
            if ev[0] == E.RECORD_STREAM and ev[4] in engine_stacks:
                dropped += 1
                continue
            kept.append(ev)
        stripped.feed(kept)
    stripped.finish()
    assert dropped > 0
    assert [(f.kind, f.previous.name, f.current.name) for f in stripped.sorted_findings()] == [
        ("missing-record-stream", "aten::cat", "allocation")]
    assert replay_trace(str(trace("real_world_programs/fsdp1_training")))["races"] == []


def test_a_replayed_memory_pool_block_waits_for_its_pool():
    """On an H200: a block allocated under ``torch.cuda.use_mem_pool``, read by another stream, freed, then an
    allocation of its owner outside the pool. The trace's pool field is what keeps it clean: without it the block
    would be taken for one of the owner's own free lists, and reported."""
    from streamsan import events as E
    from streamsan.analysis.analyzer import Analyzer
    from streamsan.trace import TraceReader

    assert replay_trace(str(trace("real_world_programs/mempool_block_not_reused_outside_pool")))["races"] == []
    stripped = Analyzer()
    pools = 0
    for batch in TraceReader(str(trace("real_world_programs/mempool_block_not_reused_outside_pool"))).batches():
        pools += sum(1 for ev in batch if ev[0] == E.ALLOC and len(ev) > 8)
        stripped.feed([ev[:8] if ev[0] == E.ALLOC else ev for ev in batch])
    stripped.finish()
    assert pools == 1
    assert [(f.kind, f.previous.name, f.current.name) for f in stripped.sorted_findings()] == [
        ("missing-record-stream", "aten::mul.Tensor", "allocation")]


def test_the_cuda_malloc_async_traces_have_only_declared_blocks_and_their_frees():
    """Every device allocation of the cuda_malloc_async traces is one the tracer declared (E.UNREPORTED_POOL), and the frees it
    learnt from storage deaths are there: the rule for an unreporting allocator is what these replays check."""
    from streamsan import events as E
    from streamsan.trace import TraceReader

    allocs = frees = 0
    for path in traces("cuda_malloc_async"):
        r = TraceReader(str(path))
        for batch in r.batches():
            for ev in batch:
                if ev[0] == E.ALLOC and ev[1] != E.PINNED:
                    assert len(ev) > 8 and ev[8] == E.UNREPORTED_POOL, (path.name, ev)
                    allocs += 1
                frees += ev[0] == E.FREE
        r.f.close()
    assert allocs > 700 and frees > 700, (allocs, frees)  # (716 and 716 when recorded)
