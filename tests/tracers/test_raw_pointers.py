"""Integer kernel arguments as pointers: the session's live allocations by address (streamsan.tracers.addresses),
CuPy raw kernels and Triton launches that take an address as an integer, and the pinned host allocator that does
not wait for such a kernel before handing its block out again (the OP_UNRECORDED rule of the analyzer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


from streamsan import events as E  # noqa: E402
from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.tracers.addresses import MIN_ADDRESS, DeviceBlocks, LiveMemory, address  # noqa: E402
from streamsan.tracers.cupy import analyses, annotations  # noqa: E402
from streamsan.tracers.pinned import PinnedBlocks  # noqa: E402

PIN = 0x7F0000000000  # a pinned host block of 4096 bytes
DEV = 0x7E0000000000  # a device block of 1024 bytes on device 0


def memory():
    mem = LiveMemory()
    pinned = PinnedBlocks()
    pinned[PIN] = 4096
    dev = DeviceBlocks()
    dev.add(0, DEV, 1024)
    mem.add_pinned(pinned)
    mem.add_device(dev)
    return mem, pinned, dev


def test_an_integer_inside_a_live_allocation_reaches_to_its_end():
    np = pytest.importorskip("numpy")
    mem, pinned, dev = memory()
    assert mem.pointed_range(PIN) == (E.PINNED, PIN, 4096)
    assert mem.pointed_range(PIN + 96) == (E.PINNED, PIN + 96, 4000)
    assert mem.pointed_range(np.uint64(DEV + 24)) == (0, DEV + 24, 1000)
    assert mem.pointed_range(PIN + 4096) is None and mem.pointed_range(DEV - 1) is None
    assert mem.pointed_range(True) is None and mem.pointed_range(1.0 * PIN) is None
    assert address(MIN_ADDRESS - 1) is None and address(MIN_ADDRESS) == MIN_ADDRESS
    assert dev.remove(DEV) and not dev.remove(DEV)
    assert mem.pointed_range(DEV + 24) is None and len(dev) == 0
    mem.add_pinned(pinned)  # registered once
    assert len(mem.pinned) == 1


class FakeArray:
    pass


class FakeTracer:
    """What a raw kernel's analysis reads of the CuPy tracer."""

    def __init__(self, mem):
        self.memory = mem
        self._ndarray = FakeArray
        self.cp = type("cp", (), {"cuda": type("cuda", (), {"MemoryPointer": type("MemoryPointer", (), {})})})


CODE = 'extern "C" __global__ void gather(const float* src, float* dst, long long n) { }'


def test_a_raw_kernel_accesses_what_its_integer_arguments_point_into():
    mem, _, _ = memory()
    t = FakeTracer(mem)
    key = ("raw", CODE, "gather")
    annotations.ACCESSES.pop(key, None)
    reads, writes, flags, _ = analyses.raw_accesses(t, key, (PIN + 64, DEV, 4096))
    assert (reads, writes) == ([], [(E.PINNED, PIN + 64, 4032), (0, DEV, 1024)])  # read-and-write: unannotated
    assert flags == E.OP_UNRECORDED  # pinned memory through a raw pointer
    annotations.cupy_access(type("K", (), {"code": CODE, "name": "gather"})(), reads=("src",), writes=("dst",))
    reads, writes, flags, _ = analyses.raw_accesses(t, key, (PIN + 64, DEV, 4096))
    assert (reads, writes) == ([(E.PINNED, PIN + 64, 4032)], [(0, DEV, 1024)])
    reads, writes, flags, _ = analyses.raw_accesses(t, key, (DEV, DEV, 8))
    assert flags == 0 and (reads, writes) == ([(0, DEV, 1024)], [(0, DEV, 1024)])
    annotations.ACCESSES.pop(key, None)


def deepep(sync_before_drop: bool, flags: int = E.OP_UNRECORDED):
    """A raw kernel on the default stream reads a pinned tensor through an integer argument; the host drops the
    tensor, pins the next batch (PyTorch's pinned allocator hands out the same block) and writes it."""
    evs = [E.stream(1, 0, 0, E.LEGACY_DEFAULT, "default"),
           E.alloc(E.PINNED, PIN, 4096, E.HOST, what="pinned batch 0"),
           E.host_access("aten::copy_", writes=[(E.PINNED, PIN, 4096)]),
           E.op(1, "cupy.RawKernel:gather", reads=[(E.PINNED, PIN, 4096)], writes=[(0, DEV, 1024)], flags=flags)]
    if sync_before_drop:
        evs.append((E.STREAM_SYNC, 1, 0))
    evs += [E.alloc(E.PINNED, PIN, 4096, E.HOST, what="pinned batch 1"),
            E.host_access("aten::copy_", writes=[(E.PINNED, PIN, 4096)])]
    an = Analyzer()
    an.feed(evs)
    return [(f.kind, f.previous.name, f.current.name) for f in an.sorted_findings()]


def test_the_pinned_allocator_does_not_wait_for_a_raw_pointer_kernel():
    assert deepep(sync_before_drop=False) == [("alloc-reuse", "cupy.RawKernel:gather", "aten::copy_")]
    assert deepep(sync_before_drop=True) == []
    assert deepep(sync_before_drop=False, flags=0) == []  # a copy: the allocator recorded an event for it


def test_a_later_recorded_access_of_the_same_stream_covers_an_unrecorded_one():
    """The allocator's event for a copy after the kernel on the same stream follows the kernel too."""
    an = Analyzer()
    an.feed([E.stream(1, 0, 0, E.LEGACY_DEFAULT, "default"),
             E.alloc(E.PINNED, PIN, 4096, E.HOST),
             E.op(1, "cupy.RawKernel:gather", writes=[(E.PINNED, PIN, 4096)], flags=E.OP_UNRECORDED),
             E.op(1, "aten::copy_", reads=[(E.PINNED, PIN, 4096)], writes=[(0, DEV, 1024)]),
             E.alloc(E.PINNED, PIN, 4096, E.HOST),
             E.host_access("aten::copy_", writes=[(E.PINNED, PIN, 4096)])])
    assert an.sorted_findings() == []


# ------------------------------------------------------------------ Triton launches in the torch tracer
torch = pytest.importorskip("torch")

from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch import device  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402
from tests.tracers.test_triton_access import fake_triton, launchable  # noqa: E402
from tests.support.torch_kit import cuda_like  # noqa: E402


def test_a_triton_integer_pointer_into_pinned_memory_is_an_unrecorded_access(monkeypatch):
    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x77)
    monkeypatch.setattr(device, "current", lambda: 0)
    t = TorchTracer(EventBuffer([lambda events: None]))
    t.start()
    try:
        t.pinned[PIN] = 4096  # a pinned tensor the tracer saw made
        module, cls, _ = fake_triton()
        t.patch_triton(module)
        k = launchable(cls, """
            def zero_copy(src_addr, out_ptr, BLOCK: tl.constexpr):
                src = src_addr.to(tl.pointer_type(tl.float32))
                tl.store(out_ptr + tl.arange(0, BLOCK), tl.load(src + tl.arange(0, BLOCK)))
        """)
        out = cuda_like(16)
        k.run(PIN + 128, out, grid=(1,), warmup=False, BLOCK=16)
        k.run(12345678, out, grid=(1,), warmup=False, BLOCK=16)  # an integer in no allocation: a scalar
        ops = [ev for ev in t.buffer.events if ev[0] == E.OP]
        assert [(ev[2], ev[3], ev[4], ev[7]) for ev in ops] == [
            ("triton:zero_copy", ((E.PINNED, PIN + 128, 3968),), ((0, out.data_ptr(), 64),), E.OP_UNRECORDED),
            ("triton:zero_copy", (), ((0, out.data_ptr(), 64),), 0)]
    finally:
        t.stop()
