"""The fix of a finding is in the API of the library whose stream objects the code holds: CuPy streams wait
with ``wait_event(s.record())`` (they have no ``wait_stream``), torch streams with ``wait_stream``, a mixed pair
through the other library's stream wrapped by its handle; CuPy memory has no ``record_stream``. Replays of
traces recorded on an H200."""

from __future__ import annotations

import pytest

from streamsan.replay import replay_trace
from tests.support.fixtures import trace



def fix_of(key: str) -> str:
    """The fix of the first finding of the trace ``"<suite>/<name>"``."""
    return replay_trace(str(trace(key)))["races"][0]["fix"]


@pytest.mark.parametrize("name,call", [
    ("real_world_programs/cusignal_stream_use_leaks_into_caller", "`kf1.wait_event(kf0.record())`"),
    ("real_world_programs/chainer_async_transfer_without_events", "`cupy.cuda.get_current_stream().wait_event(transfer.record())`"),
    ("cupy_scenarios/torch_and_cupy_streams_race", "`torch_side.wait_stream(torch.cuda.ExternalStream(cupy_side.ptr))`"),
    ("cupy_scenarios/torch_fill_then_cupy_asarray_race",
     "`cupy_side.wait_event(cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream).record())`"),
    ("cupy_scenarios/pinned_host_read_after_async_d2h", "`cupy.cuda.get_current_stream().synchronize()`"),
])
def test_cupy_and_mixed_fixes_use_calls_that_exist(name, call):
    fix = fix_of(name)
    assert fix.startswith(f"Call {call} "), fix


def test_cupy_memory_gets_no_record_stream():
    fix = fix_of("independent_programs/lifetime-cupy_pool_stream_bug")
    assert fix == ("Keep a reference to the array used at programs/lifetime/cupy_pool_stream_bug.py:34 until io is "
                   "done with it, or call `compute.wait_event(io.record())` before it is freed (at the latest before "
                   "the allocation at programs/lifetime/cupy_pool_stream_bug.py:30).")
    assert "record_stream" not in fix and "wait_stream" not in fix


def test_torch_fixes_are_unchanged():
    assert fix_of("torch_scenarios/wait_wrong_direction").startswith("Call `side.wait_stream(torch.cuda.current_stream())` before ")
