"""GPU tests: skipped without CUDA. ``STREAMSAN_RECORD_DIR=dir`` also records each scenario's trace there, named
after the test (the CPU replay fixtures under tests/replay/fixtures/<suite>/ come from such a run)."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("tests.gpu.support.scenario_kit")  # its scenario test shows the findings that differ

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.support.scenario_kit import summarize  # noqa: E402


@pytest.fixture(autouse=True)
def sound_cuda_context(request):
    """After each test, the process's CUDA context must still work: a device-side assert (a racy program whose race
    showed, reading garbage as indices) poisons it for every later test of the process. Where that happened, say
    which test it was and end the process, so that pytest-xdist starts a fresh worker for the rest."""
    yield
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # (torch.AcceleratorError, or RuntimeError in older torch)
        if "device-side assert" in str(exc) or "illegal" in str(exc):
            import sys

            sys.stderr.write(f"\n{request.node.nodeid}: left the CUDA context unusable ({str(exc).splitlines()[0]});"
                             f" this worker ends here\n")
            sys.stderr.flush()
            if os.environ.get("PYTEST_XDIST_WORKER"):
                os._exit(3)
            pytest.exit(f"{request.node.nodeid} left the CUDA context unusable", returncode=3)
        raise


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
