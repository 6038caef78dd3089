"""Byte-range shadow memory: for each byte interval, the last write and the reads since it.

Memory is physical: a :class:`ShadowSpace` covers one address space (a device, or pinned host memory) and
keeps history across frees. It is a sorted set of non-overlapping :class:`ShadowRange` intervals; gaps carry
no history. Each interval also points to the allocator block it lies in (or None for memory streamsan never
saw allocated).

:class:`Access` is one operation's access, shared by every range the operation touches.
"""

from __future__ import annotations

from bisect import bisect_right, insort


class Access:
    """An operation's access epoch and enough context to explain it later.

    ``agent`` / ``clock``: the epoch. ``seq``: index of the event in the trace (an access whose seq is below
    the ``seq`` of the block now covering its memory belongs to an earlier life of that memory). ``name``: op
    name. ``stack`` / ``ctx``: ids into the analyzer's stack and context tables. ``reads`` / ``writes``: the
    op's ranges, to confirm strided conflicts; ``strided``: one of them has a layout. ``mrs``: None, or the
    missing-record-stream findings its later races on a freed block's bytes are folded into: [(block, finding)].
    """

    __slots__ = ("agent", "clock", "seq", "name", "stack", "ctx", "mrs", "reads", "writes", "strided")

    def __init__(self, agent, clock, seq, name, stack, ctx, reads, writes, strided=False):
        self.agent = agent
        self.clock = clock
        self.seq = seq
        self.name = name
        self.stack = stack
        self.ctx = ctx
        self.mrs = None
        self.reads = reads
        self.writes = writes
        self.strided = strided

    # whether the pinned host allocator waits for this access before it hands its block out again (it records an
    # event for the copies it serves; :class:`UnrecordedAccess` is the access of an op it knows nothing of)
    recorded_by_pinned_allocator = True

    def ranges_on(self, lo: int, hi: int, write: bool):
        """This access's ranges of the given type that intersect [lo, hi)."""
        return [r for r in (self.writes if write else self.reads) if r[1] < hi and lo < r[1] + r[2]]

    def __repr__(self) -> str:
        return f"Access({self.name}@{self.agent}:{self.clock} seq={self.seq})"


class UnrecordedAccess(Access):
    """The access of an op flagged ``OP_UNRECORDED``: the pinned host allocator recorded no event for it (a kernel
    reading pinned memory through a raw pointer), so it hands the block out again without waiting for it."""

    __slots__ = ()
    recorded_by_pinned_allocator = False


class ShadowRange:
    """[start, end) with its last write and its reads since.

    ``write``: None, one Access, or a list of Accesses (strided writes that did not provably overwrite each
    other). ``reads``: None, one Access (a dense read), or a dict keyed by agent (dense reads) or by
    (agent, range) (strided reads). ``block``: the allocation life now covering it; ``prev_block``: the
    one before.
    """

    __slots__ = ("start", "end", "write", "reads", "block", "prev_block")

    def __init__(self, start, end, write=None, reads=None, block=None, prev_block=None):
        self.start = start
        self.end = end
        self.write = write
        self.reads = reads
        self.block = block
        self.prev_block = prev_block

    def accesses(self):
        w = self.write
        if w is not None:
            if type(w) is list:
                yield from w
            else:
                yield w
        r = self.reads
        if r is None:
            return
        if type(r) is dict:
            yield from r.values()
        else:
            yield r

    def retain(self, keep) -> None:
        """Forget the accesses for which ``keep(access)`` is false."""
        w = self.write
        if w is not None:
            if type(w) is list:
                kept = [x for x in w if keep(x)]
                self.write = kept if len(kept) > 1 else (kept[0] if kept else None)
            elif not keep(w):
                self.write = None
        r = self.reads
        if r is not None:
            if type(r) is dict:
                self.reads = {k: x for k, x in r.items() if keep(x)} or None
            elif not keep(r):
                self.reads = None

    def forget_known(self, clock: list) -> None:
        """Forget the accesses whose epoch is in vector clock ``clock``: those an agent at that clock has
        synchronized past."""
        # (clocks.knows written out: this runs for every access of a range at each reuse and each retirement)
        w = self.write
        if w is not None:
            if type(w) is list:
                kept = [x for x in w if x.clock > clock[x.agent]]
                self.write = kept if len(kept) > 1 else (kept[0] if kept else None)
            elif w.clock <= clock[w.agent]:
                self.write = None
        r = self.reads
        if r is not None:
            if type(r) is dict:
                self.reads = {k: x for k, x in r.items() if x.clock > clock[x.agent]} or None
            elif r.clock <= clock[r.agent]:
                self.reads = None

    def __repr__(self) -> str:
        return f"ShadowRange([{self.start:#x}, {self.end:#x}) w={self.write} r={self.reads})"


class ShadowSpace:
    """The shadow of one address space: a sorted interval map of :class:`ShadowRange`."""

    __slots__ = ("starts", "ranges")

    def __init__(self):
        self.starts: list[int] = []
        self.ranges: dict[int, ShadowRange] = {}

    def __len__(self) -> int:
        return len(self.starts)

    def _split(self, r: ShadowRange, at: int) -> ShadowRange:
        reads = r.reads
        if type(reads) is dict:
            reads = dict(reads)
        right = ShadowRange(at, r.end, r.write, reads, r.block, r.prev_block)
        r.end = at
        insort(self.starts, at)
        self.ranges[at] = right
        return right

    def cover(self, lo: int, hi: int) -> list[ShadowRange]:
        """The intervals exactly covering [lo, hi), splitting and filling gaps (new intervals carry no
        history and inherit no block)."""
        r = self.ranges.get(lo)
        if r is not None and r.end == hi:
            return [r]
        starts = self.starts
        ranges = self.ranges
        i = bisect_right(starts, lo) - 1
        out: list[ShadowRange] = []
        pos = lo
        if i >= 0:
            r = ranges[starts[i]]
            if r.end > lo:
                if r.start < lo:
                    r = self._split(r, lo)
                    i += 1
                if r.end > hi:
                    self._split(r, hi)
                out.append(r)
                pos = r.end
            i += 1
        else:
            i = 0
        n = len(starts)
        while pos < hi:
            if i < n and starts[i] < hi:
                nxt = starts[i]
                if nxt > pos:
                    gap = ShadowRange(pos, nxt)
                    starts.insert(i, pos)
                    ranges[pos] = gap
                    out.append(gap)
                    i += 1
                    n += 1
                r = ranges[starts[i]]
                if r.end > hi:
                    self._split(r, hi)
                    n += 1
                out.append(r)
                pos = r.end
                i += 1
            else:
                gap = ShadowRange(pos, hi)
                starts.insert(i, pos)
                ranges[pos] = gap
                out.append(gap)
                pos = hi
        return out

    def overlapping(self, lo: int, hi: int) -> list[ShadowRange]:
        """The existing intervals that intersect [lo, hi), unchanged."""
        starts = self.starts
        i = bisect_right(starts, lo) - 1
        if i < 0:
            i = 0
        out = []
        n = len(starts)
        while i < n and starts[i] < hi:
            r = self.ranges[starts[i]]
            if r.end > lo:
                out.append(r)
            i += 1
        return out

    def find(self, addr: int) -> ShadowRange | None:
        """The interval containing addr, if any."""
        r = self.ranges.get(addr)
        if r is not None:
            return r
        i = bisect_right(self.starts, addr) - 1
        if i >= 0:
            r = self.ranges[self.starts[i]]
            if r.end > addr:
                return r
        return None

    def merge(self, rs: list[ShadowRange]) -> ShadowRange:
        """Merge adjacent intervals that now hold the same state into the first one."""
        first = rs[0]
        last = rs[-1]
        first.end = last.end
        i = bisect_right(self.starts, first.start)
        del self.starts[i:i + len(rs) - 1]
        ranges = self.ranges
        for r in rs[1:]:
            del ranges[r.start]
        return first

    def remove(self, r: ShadowRange) -> None:
        i = bisect_right(self.starts, r.start) - 1
        del self.starts[i]
        del self.ranges[r.start]

    def __iter__(self):
        ranges = self.ranges
        for s in list(self.starts):
            r = ranges.get(s)
            if r is not None:
                yield r
