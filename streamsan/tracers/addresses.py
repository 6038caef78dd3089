"""Live allocations by address, for every tracer of a session: the allocation an integer kernel argument points
into, if any.

Raw CUDA kernels (CuPy's ``RawKernel``, ``RawModule``) and Triton kernels take pointers as plain integers too
(``tensor.data_ptr()``, ``array.data.ptr``). An integer whose value lies in a live allocation that one of the
session's tracers knows (a device block of CuPy's memory pool, a pinned host block of either library) is very
likely a pointer to it: the kernel is taken to access that allocation from the address to its end (which of its
bytes it reaches, streamsan cannot tell). Device and pinned host memory share one virtual address space (CUDA's
unified addressing), so one address names at most one allocation.

Each tracer registers the blocks it keeps (:class:`DeviceBlocks`, :class:`..pinned.PinnedBlocks`) with the
session's :class:`LiveMemory`; a lookup is a bisection in each, cheap enough for every integer argument of a
launch.
"""

from __future__ import annotations

import bisect
import numbers

from .. import events as E

# Smaller integers are sizes, counts, strides or flags: no CUDA allocation lies that low in the address space.
MIN_ADDRESS = 1 << 16


class DeviceBlocks:
    """The live device blocks a tracer allocated: start -> (device, size), and the starts in order."""

    __slots__ = ("size_of", "starts")

    def __init__(self):
        self.size_of: dict[int, tuple[int, int]] = {}
        self.starts: list[int] = []

    def add(self, device: int, start: int, size: int) -> None:
        if start not in self.size_of:
            bisect.insort(self.starts, start)
        self.size_of[start] = (device, size)

    def remove(self, start: int) -> bool:
        """Forget the block at ``start``; whether there was one."""
        if self.size_of.pop(start, None) is None:
            return False
        i = bisect.bisect_left(self.starts, start)
        del self.starts[i]
        return True

    def __contains__(self, start: int) -> bool:
        return start in self.size_of

    def __len__(self) -> int:
        return len(self.size_of)

    def find(self, ptr: int) -> tuple[int, int, int] | None:
        """(device, start, size) of the block ``ptr`` lies in."""
        starts = self.starts
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return None
        start = starts[i]
        dev, size = self.size_of[start]
        return (dev, start, size) if ptr < start + size else None


class LiveMemory:
    """The blocks the session's tracers know, each tracer's own collections registered once."""

    __slots__ = ("pinned", "device")

    def __init__(self):
        self.pinned: list = []  # PinnedBlocks of each tracer
        self.device: list = []  # DeviceBlocks of each tracer

    def add_pinned(self, blocks) -> None:
        if not any(b is blocks for b in self.pinned):
            self.pinned.append(blocks)

    def add_device(self, blocks: DeviceBlocks) -> None:
        if not any(b is blocks for b in self.device):
            self.device.append(blocks)

    def pointed_range(self, value) -> tuple | None:
        """The range an integer kernel argument reaches if it points into a live allocation: ``(space, value,
        bytes from value to the allocation's end)``, space a device index or ``PINNED``; else None."""
        ptr = address(value)
        if ptr is None:
            return None
        for blocks in self.device:
            hit = blocks.find(ptr)
            if hit is not None:
                dev, start, size = hit
                return (dev, ptr, start + size - ptr)
        for blocks in self.pinned:
            hit = blocks.find(ptr)
            if hit is not None:
                start, size = hit
                return (E.PINNED, ptr, start + size - ptr)
        return None


def address(value) -> int | None:
    """The value of an integer argument (a Python or NumPy integer, not a bool) that may be an address, else
    None."""
    if value.__class__ is int:
        v = value
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        v = int(value)
    else:
        return None
    return v if v >= MIN_ADDRESS else None
