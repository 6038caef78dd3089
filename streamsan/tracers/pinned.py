"""The pinned host blocks a tracer knows, by base address, and the lookup of the block an address lies in.

Both tracers fill one as they see pinned memory made (pinning ops, pinned allocations) and ask it whether an
address (a NumPy array's data, a tensor's storage) lies in pinned memory. Blocks are never forgotten, so a block
allocated again in part of an older one overlaps it: :meth:`PinnedBlocks.holds` answers for any block, and
:meth:`PinnedBlocks.find` gives the block with the nearest base below the address.
"""

from __future__ import annotations

import bisect


class PinnedBlocks(dict):
    """base address -> size in bytes of each pinned block seen, also indexed by base for the lookups.

    A dict, so that the hot paths' membership tests and ``get`` run at dict speed. Setting an item makes a new
    index, (the bases in order, the furthest end reached by the blocks up to each), swapped in at once: other
    threads may look up meanwhile."""

    __slots__ = ("index",)

    def __init__(self):
        super().__init__()
        self.index: tuple[list[int], list[int]] = ([], [])

    def __setitem__(self, base: int, size: int) -> None:
        if self.get(base) == size:  # (the host allocator hands its cached blocks out again and again)
            return
        dict.__setitem__(self, base, size)
        starts = sorted(self)
        reach = []
        end = 0
        for s in starts:
            end = max(end, s + self[s])
            reach.append(end)
        self.index = (starts, reach)

    def clear(self) -> None:
        dict.clear(self)
        self.index = ([], [])

    def holds(self, ptr: int) -> bool:
        """Whether ``ptr`` lies in any block."""
        starts, reach = self.index
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr < reach[i]

    def find(self, ptr: int) -> tuple[int, int] | None:
        """(base, size) of the block with the greatest base at or below ``ptr``, if ``ptr`` lies in it."""
        starts = self.index[0]
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0:
            s = starts[i]
            size = self.get(s, 0)
            if ptr < s + size:
                return s, size
        return None
