"""PyTorch's GPU trace registries call streamsan directly (no Python loop per allocation) while its callback is
the only one, and still call what others (CSAN, a profiler) register there, after streamsan's; an exception in
any callback is logged, never raised into PyTorch."""

import logging

import pytest

torch = pytest.importorskip("torch")

from torch._utils import CallbackRegistry  # noqa: E402

from streamsan.tracers.torch.callbacks import GpuTrace, call_directly  # noqa: E402


def test_streamsan_alone_is_called_directly_then_first_of_the_others(caplog):
    calls = []
    registry = CallbackRegistry("CUDA memory allocation")

    def ours(ptr):
        calls.append(("streamsan", ptr))

    call_directly(registry, ours)
    assert registry.fire_callbacks is ours
    registry.fire_callbacks(1)

    def csan(ptr):
        calls.append(("csan", ptr))
        if ptr == 3:
            raise RuntimeError("a bug in someone else's callback")

    registry.add_callback(csan)  # registered after streamsan's bypass, as CSAN does
    assert registry.callback_list == [ours, csan]
    registry.fire_callbacks(2)
    with caplog.at_level(logging.ERROR, logger="streamsan"):
        registry.fire_callbacks(3)
    assert calls == [("streamsan", 1), ("streamsan", 2), ("csan", 2), ("streamsan", 3), ("csan", 3)]
    assert "exception in a GPU trace callback for CUDA memory allocation" in caplog.text


def test_others_registered_before_streamsan_still_run():
    calls = []
    registry = CallbackRegistry("CUDA event record")
    registry.add_callback(lambda e, s: calls.append(("csan", e)))
    call_directly(registry, lambda e, s: calls.append(("streamsan", e)))
    registry.fire_callbacks(7, 0)
    assert calls == [("streamsan", 7), ("csan", 7)]


def test_an_error_in_streamsans_own_callback_is_logged_not_raised(caplog, monkeypatch):
    """The installed callbacks catch their own errors: PyTorch's allocator must never see one."""
    monkeypatch.setattr(GpuTrace, "installed", False)
    registries = {}

    class FakeTrace:
        def __getattr__(self, name):
            return registries.setdefault(name, CallbackRegistry(name))

    import torch.cuda as tc

    monkeypatch.setattr(tc, "_gpu_trace", FakeTrace(), raising=False)
    monkeypatch.setitem(__import__("sys").modules, "torch.cuda._gpu_trace", tc._gpu_trace)
    monkeypatch.setattr(torch._C, "_activate_gpu_trace", lambda: None)

    class Broken:
        tracing = True
        op_agent = None

        def __getattr__(self, name):  # (what the handlers read of a tracer)
            raise RuntimeError("tracer bug")

    monkeypatch.setattr(GpuTrace, "active", Broken())
    GpuTrace.install()
    with caplog.at_level(logging.ERROR, logger="streamsan"):
        registries["MemoryAllocationCallbacks"].fire_callbacks(0x1000)
        registries["EventRecordCallbacks"].fire_callbacks(5, 6)
    assert caplog.text.count("exception in a GPU trace callback for") == 2
