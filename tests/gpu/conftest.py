"""GPU tests: skipped without CUDA. ``STREAMSAN_RECORD_DIR=dir`` also records each scenario's trace there, named
after the test (the CPU replay fixtures under tests/replay/fixtures/<suite>/ come from such a run)."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("tests.gpu.support.scenario_kit")  # its scenario test shows the findings that differ

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.support.scenario_kit import summarize  # noqa: E402


@pytest.fixture
def san(request):
    """Run a scenario under streamsan.watch(), which must see it whole; returns (session, summary)."""
    import streamsan

    def run(fn, *args):
        trace = None
        d = os.environ.get("STREAMSAN_RECORD_DIR")
        if d:
            os.makedirs(d, exist_ok=True)
            trace = os.path.join(d, request.node.name.replace("[", "-").replace("]", "") + ".sstrace")
        torch.cuda.synchronize()
        with streamsan.watch(trace=trace) as s:
            fn(*args)
        torch.cuda.synchronize()
        assert s.complete, s.problems  # (a tracer stopped on a bug of streamsan's own would make a clean result hollow)
        return s, summarize(s)

    return run
