"""Replay traces recorded on an H200 by tests/gpu/test_{torch,cupy}_scenarios.py: the same exact findings.

The traces are real PyTorch programs (torch 2.11, CUDA 13); CI has no GPU, so this is how it checks the whole
path from a live program's events to findings.
"""

import json
from pathlib import Path

import pytest

from streamsan.replay import replay_trace

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
EXPECTED = {**json.loads((FIXTURES / "expected.json").read_text()),  # tests/gpu/test_torch_scenarios.py
            **json.loads((FIXTURES / "expected_cupy.json").read_text())}  # tests/gpu/test_cupy_scenarios.py


def summarize(report):
    return [[r["kind"], r["previous_access"]["agent"]["role"], r["previous_access"]["op"],
             r["access"]["agent"]["role"], r["access"]["op"]] for r in report["races"]]


def test_every_expectation_has_a_trace():
    assert sorted(p.stem for p in FIXTURES.glob("*.sstrace")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_replayed_scenario(name):
    report = replay_trace(str(FIXTURES / f"{name}.sstrace"))
    assert report["complete"] is True
    assert summarize(report) == EXPECTED[name]
