"""The transformers cache hooks against a stand-in ``cache_utils`` (no transformers, no GPU needed): the classes
are patched once per process, and every later session is served by the same wrappers."""

import types

import pytest

import streamsan.hooks.transformers as ht


class FakeTracer:
    def __init__(self):
        self.running = True
        self.scope = "full"
        self.ctx = 0
        self.streams = object()  # one registry per session
        self.calls = []
        self.buffer = types.SimpleNamespace(context_text=lambda ctx: "")

    def push_context(self, text):
        self.calls.append(text)
        return 0

    def pop_context(self, prev):
        pass

    def name_stream(self, stream, name):
        self.calls.append(f"name {name}")

    def label(self, tensor, text):
        self.calls.append(f"label {text}")


class FakeSession:
    def __init__(self):
        self.active = True
        self.tracer = FakeTracer()
        self.tracers = {"torch": self.tracer}
        self.notes = []

    def _note(self, text, level="warning"):
        self.notes.append(text)


def fake_cache_utils():
    mod = types.ModuleType("fake_cache_utils")

    class CacheLayerMixin:
        def prefetch(self):
            return "prefetched"

    class Cache:
        def __init__(self):
            self.offloading = True
            self.prefetch_stream = "side stream"
            self.layers = [CacheLayerMixin()]

        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            self.layers[layer_idx].prefetch()
            return key_states, value_states

    for cls in (CacheLayerMixin, Cache):
        cls.__module__ = mod.__name__
        setattr(mod, cls.__name__, cls)
    return mod


@pytest.mark.parametrize("scope", ["full", "hooks"])
def test_every_session_gets_the_cache_context_and_stream_names(monkeypatch, scope):
    cu = fake_cache_utils()
    first, second = FakeSession(), FakeSession()
    for s in (first, second):
        s.tracer.scope = scope
    monkeypatch.setattr(ht, "current", lambda: first)
    ht._patch(first, cu)
    cache = cu.Cache()
    assert cache.update("k", "v", 0) == ("k", "v")
    monkeypatch.setattr(ht, "current", lambda: second)
    ht._patch(second, cu)  # the next session's install: already patched
    assert cache.update("k", "v", 0) == ("k", "v")
    for s in (first, second):
        assert s.tracer.calls == ["name prefetch_stream", "transformers Cache.update(layer_idx=0)",
                                  "transformers CacheLayerMixin.prefetch() [layer 0]"]


def test_without_an_active_session_the_wrappers_only_call_through(monkeypatch):
    cu = fake_cache_utils()
    session = FakeSession()
    monkeypatch.setattr(ht, "current", lambda: session)
    ht._patch(session, cu)
    session.active = False
    assert cu.Cache().update("k", "v", 0) == ("k", "v")
    monkeypatch.setattr(ht, "current", lambda: None)
    assert cu.Cache().update("k", "v", 0) == ("k", "v")
    assert session.tracer.calls == []
