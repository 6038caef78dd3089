"""The race rule: which pairs of accesses race, checked against shadow memory as each access arrives.

:func:`unordered` is the happens-before test of two accesses; every decision that two accesses race goes through
it. :class:`ShadowChecker` applies one op's reads and writes to the shadow memory: a write races with the last
write and every read since that are unordered with it, a read with the last write; strided views race only where
their elements share a byte. Each race goes to the finding log. The contract is ``docs/semantics.md`` ("Accesses
and the race rule").
"""

from __future__ import annotations

from .. import events as E
from .clocks import Clocks, knows
from .layout import touch_common_bytes
from .shadow import Access, ShadowSpace

HOST = E.HOST
MAX_STRIDED_STATE = 64  # distinct strided views kept per shadow range before forgetting


def unordered(prev: Access, agent: int, clock: list) -> bool:
    """Whether the earlier access ``prev`` does not happen before what ``agent`` does now, at vector clock
    ``clock``: it is another agent's and ``clock`` does not know it (:func:`~streamsan.analysis.clocks.knows`)."""
    # (knows written out: this test runs for every earlier access each access meets)
    return prev.agent != agent and prev.clock > clock[prev.agent]


def _share_a_byte(prev: Access, prev_write: bool, r, strided: bool, seg) -> bool:
    """Whether prev's ranges of the given access type and range r (``strided``: r has a layout) share a byte of
    seg: dense ranges over it always do, strided views only where their elements meet."""
    if not (strided or prev.strided):
        return True
    for pr in prev.ranges_on(seg.start, seg.end, prev_write):
        if touch_common_bytes(pr, r):
            return True
    return False


class ShadowChecker:
    """Checks accesses against the shadow memory (``shadow``: space -> :class:`ShadowSpace`) and updates it.

    A checked access is also remembered, on the block under each range, as that block's last access by a stream
    other than its owner (``Block.foreign``: what the missing-record-stream rule looks at when the block is freed).
    Races go to ``log.race``.
    """

    def __init__(self, shadow: dict, clocks: Clocks, log):
        self.shadow = shadow
        self.clocks = clocks
        self.log = log

    def space(self, space: int) -> ShadowSpace:
        """The shadow of an address space, made on first use."""
        sh = self.shadow.get(space)
        if sh is None:
            sh = self.shadow[space] = ShadowSpace()
        return sh

    def write(self, r, acc: Access, t: list) -> None:
        """acc writes range r (``t``: its agent's clock): it races with the last write and every read since that
        are unordered with it (the reads only when no write raced)."""
        a = acc.agent
        space = r[0]
        sh = self.shadow.get(space)
        if sh is None:
            sh = self.space(space)
        lo = r[1]
        hi = lo + r[2]
        seg = sh.ranges.get(lo)
        segs = (seg,) if seg is not None and seg.end == hi else sh.cover(lo, hi)
        strided = len(r) > 3
        if strided:
            acc.strided = True
        for seg in segs:
            blk = seg.block
            if blk is not None and a != blk.owner and a != HOST:
                if blk.foreign is None:
                    blk.foreign = {}
                blk.foreign[a] = acc
            raced = False
            w = seg.write
            if w is not None:
                if type(w) is list:  # (strided writes on disjoint elements: each one's race is its own)
                    for x in w:
                        if unordered(x, a, t) and _share_a_byte(x, True, r, strided, seg):
                            self.log.race(x, True, acc, True, seg, space)
                            raced = True
                elif unordered(w, a, t) and _share_a_byte(w, True, r, strided, seg):
                    self.log.race(w, True, acc, True, seg, space)
                    raced = True
            rd = seg.reads
            if rd is not None and not raced:
                if type(rd) is dict:  # (one read per stream: each unordered one is a race of its own)
                    for x in rd.values():
                        if unordered(x, a, t) and _share_a_byte(x, False, r, strided, seg):
                            self.log.race(x, False, acc, True, seg, space)
                elif unordered(rd, a, t) and _share_a_byte(rd, False, r, strided, seg):
                    self.log.race(rd, False, acc, True, seg, space)
            if strided:
                # A strided write overwrites only its elements: keep what it may not have overwritten.
                if w is None:
                    seg.write = acc
                else:
                    kept = [x for x in (w if type(w) is list else (w,))
                            if x.ranges_on(seg.start, seg.end, True) != acc.ranges_on(seg.start, seg.end, True)]
                    kept.append(acc)
                    if len(kept) > MAX_STRIDED_STATE:
                        h = self.clocks.vc[HOST]
                        kept = [x for x in kept[:-1] if not knows(h, x)][-(MAX_STRIDED_STATE - 1):] + [acc]
                    seg.write = kept if len(kept) > 1 else acc
            else:
                seg.write = acc
                seg.reads = None
        if len(segs) > 1 and not strided:
            b0 = segs[0].block
            if all(s.block is b0 for s in segs):
                sh.merge(segs)

    def read(self, r, acc: Access, t: list) -> None:
        """acc reads range r (``t``: its agent's clock): it races with the last write if that is unordered with
        it. The reads kept are one per stream (dense) or per stream and view (strided) while unordered."""
        a = acc.agent
        space = r[0]
        sh = self.shadow.get(space)
        if sh is None:
            sh = self.space(space)
        lo = r[1]
        hi = lo + r[2]
        seg = sh.ranges.get(lo)
        segs = (seg,) if seg is not None and seg.end == hi else sh.cover(lo, hi)
        strided = len(r) > 3
        if strided:
            acc.strided = True
        for seg in segs:
            blk = seg.block
            if blk is not None and a != blk.owner and a != HOST:
                if blk.foreign is None:
                    blk.foreign = {}
                blk.foreign[a] = acc
            w = seg.write
            if w is not None:
                if type(w) is list:
                    for x in w:
                        if unordered(x, a, t) and _share_a_byte(x, True, r, strided, seg):
                            self.log.race(x, True, acc, False, seg, space)
                elif unordered(w, a, t) and _share_a_byte(w, True, r, strided, seg):
                    self.log.race(w, True, acc, False, seg, space)
            rd = seg.reads
            if not strided:
                if rd is None:
                    seg.reads = acc
                elif type(rd) is dict:
                    rd[a] = acc
                elif not unordered(rd, a, t):
                    seg.reads = acc
                else:
                    seg.reads = {rd.agent: rd, a: acc}
            else:
                key = (a, r)
                if rd is None:
                    seg.reads = {key: acc}
                elif type(rd) is dict:
                    rd[key] = acc
                    if len(rd) > MAX_STRIDED_STATE:
                        h = self.clocks.vc[HOST]
                        for k in [k for k, x in rd.items() if knows(h, x)]:
                            del rd[k]
                        while len(rd) > MAX_STRIDED_STATE:  # beyond the bound: forget the oldest
                            del rd[next(iter(rd))]
                else:
                    seg.reads = {rd.agent: rd, key: acc}
