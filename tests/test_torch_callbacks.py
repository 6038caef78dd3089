"""PyTorch's GPU trace registries call streamsan directly (no Python loop per allocation), and still call what
others (CSAN, a profiler) register there; an exception in any callback is logged, never raised into PyTorch."""

import logging

import pytest

torch = pytest.importorskip("torch")

from torch._utils import CallbackRegistry  # noqa: E402

from streamsan.tracers.torch import _direct_fire  # noqa: E402


def test_streamsan_first_then_the_others_and_errors_are_logged(caplog):
    calls = []
    registry = CallbackRegistry("CUDA memory allocation")

    def ours(ptr):
        calls.append(("streamsan", ptr))
        if ptr == 2:
            raise RuntimeError("a bug in a callback")

    registry.add_callback(ours)
    registry.fire_callbacks = _direct_fire(registry, ours)
    registry.fire_callbacks(1)
    registry.add_callback(lambda ptr: calls.append(("csan", ptr)))  # registered after streamsan's bypass
    with caplog.at_level(logging.ERROR, logger="streamsan"):
        registry.fire_callbacks(2)
    assert calls == [("streamsan", 1), ("streamsan", 2), ("csan", 2)]
    assert "exception in a GPU trace callback for CUDA memory allocation" in caplog.text
