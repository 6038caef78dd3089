"""``query()`` returning True is a synchronization that no GPU trace callback reports: streamsan patches it on
``torch.cuda.Event`` / ``torch.cuda.Stream`` and on the generic ``torch.Event`` / ``torch.Stream``, which are
immutable C types, and restores each class exactly when tracing stops."""

import ctypes
import gc

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.patches.attributes import set_type_attr  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402

CLASSES = [torch.Event, torch.Stream, torch.cuda.Event, torch.cuda.Stream]


def test_query_is_patched_while_tracing_and_restored_after():
    originals = {cls: cls.__dict__["query"] for cls in CLASSES}
    events = []
    tracer = TorchTracer(EventBuffer([events.extend]))
    tracer.start()
    try:
        for cls in CLASSES:
            patched = cls.__dict__["query"]
            assert patched is not originals[cls], cls
            assert patched.__wrapped__ is originals[cls]
            assert cls.query is patched  # attribute lookup sees the new entry (the type cache was invalidated)
        assert torch.Event().query() is True  # a CPU event: the original answer, and no synchronization event
        assert torch.Stream().query() is True
    finally:
        tracer.stop()
    for cls in CLASSES:
        assert cls.__dict__["query"] is originals[cls]
        assert cls.query is originals[cls]
    assert torch.Event().query() is True
    assert not [e for e in events if e[0] in (E.EVENT_SYNC, E.STREAM_SYNC)]


def test_setting_an_attribute_of_an_immutable_type():
    with pytest.raises(TypeError):
        torch.Event.streamsan_probe = 1
    assert set_type_attr(torch.Event, "streamsan_probe", 1)
    try:
        assert torch.Event().streamsan_probe == 1
    finally:
        (own,) = [d for d in gc.get_referents(torch.Event.__dict__) if isinstance(d, dict)]
        del own["streamsan_probe"]
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(torch.Event))
    assert not hasattr(torch.Event, "streamsan_probe")
