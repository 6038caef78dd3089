"""Lives of memory: allocations, frees, ``record_stream``, and what an earlier life's history means for the next.

An allocation starts a life of its bytes, a free ends it; the shadow memory keeps the history across lives. The
survival rule (which accesses of an earlier life stay unordered with a new one: for the caching allocator and the
pinned host allocator in :meth:`Lifetimes.alloc`, for an allocator that reports no frees in
:func:`end_unreported_life`) and the missing-record-stream rule (a freed block's foreign access still in flight
when its owner allocates again: :func:`in_flight_for_owner`) are here, and memory handed back to the driver, seen
(RELEASE) or implied by a block that changed stream or pool (:func:`went_through_driver`), after which no earlier
access of it is pending. The contract is ``docs/semantics.md`` ("Allocations, lives and the allocator", "Memory
handed back to the driver", "Missing record_stream").
"""

from __future__ import annotations

from .. import events as E
from .allocator import AllocatorModel, Block
from .clocks import Clocks, knows
from .findings import FindingLog
from .race import ShadowChecker
from .shadow import Access

HOST = E.HOST
PINNED = E.PINNED


# ---------------------------------------------------------------------- the survival rule
def in_flight_for_owner(x: Access, own: list, h: list) -> bool:
    """Whether a freed block's foreign access x may still be in flight for its owner's allocator: neither the owner
    (``own``: its clock) nor the host (``h``) has synchronized past it."""
    return not (knows(own, x) or knows(h, x))


def allocator_waited_for(x: Access, old_block) -> bool:
    """Whether the caching allocator waited for an access of an earlier life of device memory before handing it
    out again: a recorded user's access in that block's own life."""
    return x.agent != HOST and old_block is not None and x.agent in old_block.recorded and x.seq >= old_block.seq


def pinned_survivors(seg):
    """Which accesses of an earlier life of pinned bytes (``seg``'s) the pinned host allocator did not wait for,
    as a predicate: the host's, and a stream's access of an ``OP_UNRECORDED`` op (a raw-pointer kernel) unless
    the same stream accessed those bytes later through an op it knows of (the event it records for that one
    comes later in the stream's order)."""
    waited: dict = {}  # stream -> the latest clock of its accesses here that the allocator recorded
    for x in seg.accesses():
        if x.agent != HOST and x.recorded_by_pinned_allocator and x.clock > waited.get(x.agent, -1):
            waited[x.agent] = x.clock
    return lambda x: x.agent == HOST or x.clock > waited.get(x.agent, -1)


def went_through_driver(old_block, owner: int, pool: int, space: int) -> bool:
    """Whether memory that ``old_block`` held reaches an allocation of ``owner`` from ``pool`` only through the
    driver: a caching allocator (PyTorch's, in its own or a private pool) hands a freed block only to allocations on
    the stream it was allocated on, from the pool it came from, so memory that moves to another stream or pool was
    released (``cudaFree``, which waits for the whole device) and obtained again in between: every earlier access of
    it has completed. Not for pinned memory, another library's pool or an allocator that reports no frees."""
    return (old_block is not None and space != PINNED and pool >= 0 and old_block.pool >= 0
            and (old_block.owner != owner or old_block.pool != pool))


def end_unreported_life(seg, h: list, old_block, vc: list) -> None:
    """An allocator that reports no frees (``E.UNREPORTED_POOL``) hands seg's bytes out again (``old_block``: the
    life there before, maybe still live): an access of an earlier life stays in the shadow unless the host, the old
    block's owner or one of its recorded users had seen it by now (the driver orders the allocation after the
    owner's free, which PyTorch issues after those streams' work); accesses to memory no declared block held
    (allocated before tracing began) are forgotten: nothing tells whose they were."""
    if old_block is None:
        seg.write = seg.reads = None
        return
    seg.forget_known(h)
    seg.forget_known(vc[old_block.owner])
    for g in old_block.recorded:
        seg.forget_known(vc[g])


class Lifetimes:
    """Applies ALLOC, FREE, RECORD_STREAM and LABEL events (each with ``seq``, its index in the trace) to the
    allocator model and the shadow memory.

    Counts allocations and frees in ``counts``; ``note(level, text)`` records an analysis note, ``ensure_agent(a)``
    declares a stream used before its declaration; missing-record-stream findings go to ``log``.
    """

    def __init__(self, allocator: AllocatorModel, shadow: dict, clocks: Clocks, checker: ShadowChecker,
                 log: FindingLog, counts: dict, note, ensure_agent):
        self.allocator = allocator
        self.shadow = shadow
        self.clocks = clocks
        self.agents = clocks.agents
        self.checker = checker
        self.log = log
        self.counts = counts
        self.note = note
        self.ensure_agent = ensure_agent

    def alloc(self, ev, seq: int) -> None:
        """A new life of [start, start + size)."""
        _, space, start, size, owner, stack, ctx, what = ev[:8]
        pool = ev[8] if len(ev) > 8 else 0
        self.counts["allocs"] += 1
        if owner != HOST and owner not in self.agents:
            self.ensure_agent(owner)
        end = start + size
        alloc = self.allocator
        blk = alloc.new_block(space, start, size, owner, stack, ctx, what, seq, pool)
        unreported = pool == E.UNREPORTED_POOL
        # (such an allocation is work on its stream: enqueued before the pending check, which it orders after)
        t = self.clocks.enqueue(owner) if unreported and owner != HOST else None
        pend = alloc.pending.pop((owner, pool), None) if alloc.pending and owner != HOST else None
        if pend:
            self._check_pending(pend, blk, seq)
        if size <= 0:
            return
        sh = self.shadow.get(space)
        if sh is None:
            sh = self.checker.space(space)
        seg = sh.ranges.get(start)
        segs = (seg,) if seg is not None and seg.end == end else sh.cover(start, end)
        vc = self.clocks.vc
        h = vc[HOST]
        earlier = [] if t is not None else None  # the ranges an unreporting allocator's allocation hands out again
        for seg in segs:
            ob = seg.block
            if ob is not None and not ob.freed:
                # Pinned frees are not observable, nor are an unreporting allocator's: a new block over a live one
                # ends the old life.
                if space != PINNED and not unreported:
                    self.note("warning", "an allocation overlapped live memory (a free was not seen)")
                alloc.release(ob)
            seg.prev_block = ob
            seg.block = blk
            if went_through_driver(ob, owner, pool, space):
                seg.write = seg.reads = None
                if alloc.pending:
                    alloc.forget_pending(space, 0, 0, only=ob)
                continue
            if unreported:
                end_unreported_life(seg, h, ob, vc)
                if ob is not None and earlier is not None:
                    if earlier and earlier[-1][1] == seg.start:
                        earlier[-1][1] = seg.end
                    else:
                        earlier.append([seg.start, seg.end])
                continue
            # The survival rule of a reporting allocator (the deferred-reuse edge): an access of an earlier life
            # stays in the shadow unless the host synchronized past it or the allocator waited for it.
            seg.forget_known(h)
            if space == PINNED:
                seg.retain(pinned_survivors(seg))
            elif ob is not None and ob.recorded:
                seg.retain(lambda x: not allocator_waited_for(x, ob))
        if earlier:
            self._allocation_write(space, earlier, owner, stack, ctx, t, seq)

    def _allocation_write(self, space: int, earlier: list, owner: int, stack: int, ctx: int, t: list,
                          seq: int) -> None:
        """An unreporting allocator's allocation is stream-ordered work on its stream (cudaMallocAsync): a write,
        there and then, of the bytes it hands out again (``earlier``: [start, end) ranges a declared block held;
        ``t``: the stream's clock, the allocation enqueued). It races with the earlier life's accesses that
        :func:`end_unreported_life` kept, and with later accesses of other streams not ordered after it.
        Fresh bytes get no such write: with no earlier life in the trace nothing can be pending there (the
        reporting allocator's rule too)."""
        rs = tuple((space, lo, hi - lo) for lo, hi in earlier)
        acc = Access(owner, t[owner], seq, "allocation", stack, ctx, (), rs)
        for r in rs:
            self.checker.write(r, acc, t)

    def _check_pending(self, pend, blk: Block, seq: int) -> None:
        """Missing record_stream: the owner's allocator may hand these freed blocks to ``blk``'s allocation."""
        owner = blk.owner
        own = self.clocks.vc[owner]
        h = self.clocks.vc[HOST]
        log = self.log
        cur = Access(owner, own[owner], seq, "allocation", blk.stack, blk.ctx, (), ())
        for old, xs in pend:
            reused = old.space == blk.space and old.start < blk.end and blk.start < old.end
            for x in xs:
                if not in_flight_for_owner(x, own, h):
                    continue
                f = log.missing_record_stream(x, old, cur, blk if reused else None)
                log.fold_into(f, old, x, self.shadow)
                if reused:
                    f.reused = True
                    if f.block is None:  # (first met where no block was handed on: this is the one that was)
                        f.block = blk

    def free(self, ev, seq: int) -> None:
        """The end of the live block at (space, start); its unrecorded foreign accesses still in flight wait for the
        owner's next allocation from its pool."""
        self.counts["frees"] += 1
        live = self.allocator.live.get(ev[1])
        blk = live.get(ev[2]) if live is not None else None
        if blk is None:
            return
        if not blk.foreign:
            blk.freed = True
            del live[ev[2]]
            return
        vc = self.clocks.vc
        own = vc[blk.owner]
        h = vc[HOST]
        blk.freed_at = seq
        unwaited = self.allocator.release(blk)
        pend = [x for x in unwaited if in_flight_for_owner(x, own, h)]
        if pend:
            self.allocator.defer(blk, pend)

    def release(self, ev, _seq: int) -> None:
        """RELEASE: the allocator handed [start, start + size) back to the driver, which waited for every access of
        it; the shadow forgets them (nothing later can race with them), and no free list holds the blocks there any
        more (their pending foreign accesses are dropped; a block still live there had a free that was not seen)."""
        _, space, start, size, _stack = ev
        if size <= 0:
            return
        end = start + size
        alloc = self.allocator
        if alloc.pending:
            alloc.forget_pending(space, start, end)
        sh = self.shadow.get(space)
        if sh is None or not sh.overlapping(start, end):
            return
        for seg in sh.cover(start, end):
            ob = seg.block
            if ob is not None and not ob.freed:
                alloc.release(ob)
            sh.remove(seg)

    def block_at(self, space: int, start: int):
        """The live block at start: one starting there, else the one whose shadow range holds it."""
        blk = self.allocator.live_block(space, start)
        if blk is None:
            sh = self.shadow.get(space)
            seg = sh.find(start) if sh is not None else None
            if seg is not None and seg.block is not None and not seg.block.freed:
                blk = seg.block
        return blk

    def record_stream(self, ev, _seq: int) -> None:
        _, space, start, agent, _stack = ev
        blk = self.block_at(space, start)
        # (the allocator ignores uses on the allocation stream, and memory it did not allocate)
        if blk is not None and agent != blk.owner and blk.pool != E.FOREIGN_POOL:
            blk.recorded = blk.recorded | {agent}

    def label(self, ev, _seq: int) -> None:
        _, space, start, _size, text = ev
        blk = self.block_at(space, start)
        if blk is not None:
            blk.label = text
