"""The torch tracer and ``torch.cuda.use_mem_pool`` (CPU: a stand-in context manager takes the pool routing's
place): allocations of the routed thread carry the pool, others do not, and the analyzer checks a pool block's
pending accesses at the owner's next allocation from that pool only."""

import contextlib
import threading
import types

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.callbacks import on_alloc  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402


@pytest.fixture
def tracer(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        entered.append(pool.id)
        yield

    monkeypatch.setattr(torch.cuda.memory, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    t = TorchTracer(EventBuffer([lambda events: None]))
    t.start()
    t.entered = entered
    yield t
    t.stop()
    assert torch.cuda.use_mem_pool is use_mem_pool  # restored


def alloc_in_op(t, ptr):
    own = []
    t.op_agent = (0, 1, 0, 0, threading.get_ident(), own)
    on_alloc(t, ptr)
    t.op_agent = None
    (ev,) = own
    return ev


def test_allocations_inside_use_mem_pool_carry_the_pool(tracer):
    a, b = types.SimpleNamespace(id=(0, 5)), types.SimpleNamespace(id=(0, 9))
    assert alloc_in_op(tracer, 0x100) == (E.ALLOC, 0, 0x100, 0, 1, 0, 0, "")
    with torch.cuda.use_mem_pool(a):
        assert alloc_in_op(tracer, 0x200)[8:] == (1,)
        with torch.cuda.memory.use_mem_pool(b):
            assert alloc_in_op(tracer, 0x300)[8:] == (2,)
        assert alloc_in_op(tracer, 0x400)[8:] == (1,)
        seen = []
        th = threading.Thread(target=lambda: seen.append(tracer.pool_of_thread.get(threading.get_ident())))
        th.start()
        th.join()
        assert seen == [None]  # only the calling thread is routed
    with torch.cuda.use_mem_pool(a):
        assert alloc_in_op(tracer, 0x500)[8:] == (1,)  # the same pool, the same number
    assert alloc_in_op(tracer, 0x600)[8:] == ()
    assert tracer.entered == [(0, 5), (0, 9), (0, 5)]
    assert tracer.pool_of_thread == {}


def test_a_pool_block_waits_for_an_allocation_from_its_pool():
    side, default = 1, 2
    evs = [E.stream(side, 0, 0x10, 0, "side"), E.stream(default, 0, 0x20, 0, "default"),
           E.alloc(0, 0x1000, 256, side, pool=1),
           E.op(default, "aten::mul.Tensor", reads=[(0, 0x1000, 256)]),
           E.free(0, 0x1000),
           E.alloc(0, 0x8000, 256, side),  # outside the pool: cannot get the block
           E.op(side, "aten::fill_.Scalar", writes=[(0, 0x8000, 256)])]
    a = Analyzer()
    a.feed(evs)
    assert a.sorted_findings() == []
    a.feed([E.alloc(0, 0x1000, 128, side, pool=1), E.op(side, "aten::fill_.Scalar", writes=[(0, 0x1000, 128)])])
    a.finish()
    (f,) = a.sorted_findings()
    assert (f.kind, f.previous.name, f.current.name, f.reused) == (
        "missing-record-stream", "aten::mul.Tensor", "allocation", True)


def test_use_mem_pool_still_decorates(tracer):
    pool = types.SimpleNamespace(id=(0, 3))

    @torch.cuda.use_mem_pool(pool)
    def allocate(ptr):
        return alloc_in_op(tracer, ptr)[8:]

    assert allocate(0x100) == (1,)
    assert allocate(0x200) == (1,)  # (a generator-based context manager is made anew for each call)
    assert alloc_in_op(tracer, 0x300)[8:] == ()
    assert tracer.entered == [(0, 3), (0, 3)]
