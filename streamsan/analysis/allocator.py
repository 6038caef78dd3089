"""The allocator model: blocks, their owner stream, record_stream users and frees still pending.

A :class:`Block` is one life of an allocation. The caching allocator hands a freed block to the next
allocations on its owner stream at once, except that it waits for the work of streams named by
``record_stream``. So a freed block whose life saw an access by another, unrecorded stream leaves a
*pending* access: :class:`AllocatorModel` keeps those per owner stream (and private memory pool, where the
block came from one) until the owner's next allocation from the same pool, where the analysis decides whether
they are still unordered (``docs/semantics.md``, "Missing record_stream"). Memory the allocator hands back to the
driver leaves every free list, and its pending accesses with it (:meth:`AllocatorModel.forget_pending`).
"""

from __future__ import annotations

from ..events import PINNED


_NO_STREAMS: frozenset = frozenset()


class Block:
    """One life of an allocation: [start, start + size) in a space, owned by an agent (a stream, or the host
    for pinned memory)."""

    __slots__ = ("space", "start", "size", "owner", "serial", "recorded", "foreign", "freed", "stack", "ctx",
                 "what", "label", "seq", "pool", "freed_at")

    def __init__(self, space, start, size, owner, serial, stack=0, ctx=0, what="", seq=-1, pool=0):
        self.space = space
        self.start = start
        self.size = size
        self.owner = owner
        self.serial = serial
        self.recorded: set[int] = _NO_STREAMS  # streams named by record_stream (a new set once one is added)
        self.foreign: dict[int, object] | None = None  # stream agent -> its last Access to this block
        self.pool = pool  # a private memory pool's id, or 0: the owner's own free lists
        self.freed = False
        self.freed_at = 1 << 62  # the seq of its FREE, once freed with foreign accesses pending
        self.stack = stack
        self.ctx = ctx
        self.what = what
        self.label = ""
        self.seq = seq

    @property
    def end(self) -> int:
        return self.start + self.size

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return f"Block({self.space}, [{self.start:#x}, +{self.size}), owner={self.owner}, {state})"


class AllocatorModel:
    """Live blocks by (space, start) and, per (owner stream, pool), the freed blocks with pending foreign accesses:
    a freed block goes back to its pool's free lists (the owner's own ones for pool 0), so only that pool's next
    allocation on the owner can get it."""

    def __init__(self):
        self.live: dict[int, dict[int, Block]] = {}
        self.pending: dict[tuple[int, int], list[tuple[Block, list]]] = {}
        self._serial = 0

    def new_block(self, space, start, size, owner, stack, ctx, what, seq, pool=0) -> Block:
        self._serial += 1
        b = Block(space, start, size, owner, self._serial, stack, ctx, what, seq, pool)
        self.live.setdefault(space, {})[start] = b
        return b

    def live_block(self, space: int, start: int) -> Block | None:
        d = self.live.get(space)
        return d.get(start) if d else None

    def release(self, block: Block) -> list:
        """Mark block freed; returns the accesses the allocator does not wait for before handing it out again:
        each other stream's last access to it, unless ``record_stream`` named that stream (none for pinned memory,
        whose allocator waits for every stream)."""
        block.freed = True
        d = self.live.get(block.space)
        if d is not None and d.get(block.start) is block:
            del d[block.start]
        if block.space == PINNED or not block.foreign:
            block.foreign = None
            return []
        recorded = block.recorded
        unwaited = [a for g, a in block.foreign.items() if g not in recorded]
        block.foreign = None
        return unwaited

    def defer(self, block: Block, accesses: list) -> None:
        """Keep a freed block's accesses still in flight pending until its owner's next allocation from its pool."""
        self.pending.setdefault((block.owner, block.pool), []).append((block, accesses))

    def forget_pending(self, space: int, lo: int, hi: int, only=None) -> None:
        """Drop the pending foreign accesses of freed blocks with bytes in [lo, hi) of a space (``only``: of that
        block alone): that memory went back to the driver, which waited for every access of it, and no free list
        holds it any more."""
        for key in list(self.pending):
            kept = [(b, xs) for b, xs in self.pending[key]
                    if not (b is only if only is not None else b.space == space and b.start < hi and lo < b.end)]
            if kept:
                self.pending[key] = kept
            else:
                del self.pending[key]

    def live_count(self) -> int:
        return sum(len(d) for d in self.live.values())
