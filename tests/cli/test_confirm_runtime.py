"""The confirm runtime on the CPU: the ops it matches at a call site (as findings spell it), the occurrences it
delays, the observations it writes at exit; CUDA itself (the delay, the checksums on a stream) stands in."""

import json
import sys
import threading

import pytest
import torch

from streamsan.confirm import runtime as rt_module
from streamsan.analysis.locations import short_path
from streamsan.confirm.runtime import Runtime, call_site

HERE = short_path(__file__)


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(open(__file__), 1) if marker in text and "line_of" not in text)


def test_the_call_site_is_the_innermost_user_frame_as_findings_spell_it():
    site = call_site(sys._getframe())  # the site
    assert site == f"{HERE}:{line_of('# the site')}"


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """CUDA as the runtime asks for it, on the CPU: available, never capturing; checksums of CPU tensors."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(rt_module, "torch_checksum",
                        lambda torch, ts: torch.stack([sum(t.double().sum() for t in ts), torch.tensor(0.0,
                                                       dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)]))


def run_under(spec, fn):
    rt = Runtime(spec)
    delays = []
    rt.torch_delay = lambda: delays.append(len(rt.obs.sequence))
    rt.start_torch(torch)
    try:
        fn()
    finally:
        rt.mode.__exit__(None, None, None)
        threading.setprofile(None)
    rt.finish()
    return rt, delays


def program():
    a = torch.ones(4)
    for i in range(3):
        b = a + i  # the add
        c = b * 2  # the mul
    return c


def test_ops_at_the_planned_sites_are_counted_delayed_and_checksummed(tmp_path, cuda_stand_in):
    add, mul = f"{HERE}:{line_of('# the add')}", f"{HERE}:{line_of('# the mul')}"
    spec = {"sites": [{"location": add, "op": "aten::add.Tensor"}, {"location": mul, "op": None}],
            "delay_site": 0, "delay_ms": 20.0, "occurrences": 2, "out_dir": str(tmp_path)}
    rt, delays = run_under(spec, program)
    assert delays == [1, 3]  # before the first two adds (the sequence held the add itself, then add, mul, add)
    out = json.loads(next(tmp_path.glob("observed-*.json")).read_text())
    assert out["sites"] == [f"aten::add.Tensor @ {add}", f"* @ {mul}"]
    assert out["sequence"] == [0, 1, 0, 1, 0, 1] and out["delayed"] == 2 and out["error"] is None
    assert out["values"] == [[0, 1, [4.0, 0.0, 0.0]], [1, 1, [8.0, 0.0, 0.0]], [0, 2, [8.0, 0.0, 0.0]],
                             [1, 2, [16.0, 0.0, 0.0]], [0, 3, [12.0, 0.0, 0.0]], [1, 3, [24.0, 0.0, 0.0]]]


def test_an_op_of_another_name_or_line_is_not_matched(tmp_path, cuda_stand_in):
    add = f"{HERE}:{line_of('# the add')}"
    spec = {"sites": [{"location": add, "op": "aten::mul.Tensor"}, {"location": add + "0", "op": None}],
            "delay_site": 0, "delay_ms": 20.0, "occurrences": None, "out_dir": str(tmp_path)}
    rt, delays = run_under(spec, program)
    assert delays == [] and rt.obs.sequence == [] and rt.delayed == 0


def test_named_values_are_observed_after_the_sites(tmp_path, cuda_stand_in):
    spec = {"sites": [], "delay_site": None, "delay_ms": 20.0, "occurrences": None, "out_dir": str(tmp_path)}
    rt = Runtime(spec)
    rt.torch = torch
    rt.observe(torch.ones(3), "logits")
    rt.observe(torch.ones(3) * 2, "logits")
    rt.finish()
    out = json.loads(next(tmp_path.glob("observed-*.json")).read_text())
    assert out["sites"] == ["observe(logits)"] and out["sequence"] == [0, 0]
    assert [v[:2] for v in out["values"]] == [[0, 1], [0, 2]] and out["values"][1][2][0] == 6.0


def test_observe_outside_a_confirm_run_does_nothing():
    import streamsan

    assert rt_module._runtime is None
    streamsan.observe(torch.ones(2), "logits")
    assert rt_module._runtime is None
