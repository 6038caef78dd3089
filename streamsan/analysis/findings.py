"""Findings: one hazard each, with its fingerprint, occurrence count and the facts needed to explain it.

A finding is built from two :class:`~streamsan.analysis.shadow.Access` records. Its fingerprint is stable across
runs and machines: the kind plus the innermost *user-code* location of each access
(:mod:`~streamsan.analysis.locations`), so one bug in a loop is one finding with a count, not one per iteration.
:class:`FindingLog` turns the races and missing record_streams the analysis meets into findings: it classifies
them, folds races into the missing-record-stream finding that explains them, and counts repeats once per pair of
accesses.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from .. import events as E
from .locations import location

DEVICE_DEVICE = "device-device"
HOST_DEVICE = "host-device"
ALLOC_REUSE = "alloc-reuse"
MISSING_RECORD_STREAM = "missing-record-stream"
KINDS = (DEVICE_DEVICE, HOST_DEVICE, ALLOC_REUSE, MISSING_RECORD_STREAM)

HOST = E.HOST


def fingerprint(kind: str, loc_prev: str, loc_cur: str) -> str:
    return hashlib.sha1(f"{kind}|{loc_prev}|{loc_cur}".encode()).hexdigest()[:16]


class Finding:
    """One distinct hazard.

    ``previous`` / ``current``: the earlier and the later access (Access objects; for missing-record-stream the
    later one is the allocation on the owner stream that was free to reuse the block). ``prev_write`` /
    ``cur_write``: their access types on the conflicting memory. ``space``, ``lo``, ``hi``: where the conflict
    was found (for missing-record-stream, the freed block). ``block``: the allocation life of the later
    access's memory; ``prev_block``: the earlier life, for alloc-reuse and missing-record-stream.
    ``reused``: the block really was handed to the new allocation.
    """

    __slots__ = ("kind", "fingerprint", "count", "previous", "current", "prev_write", "cur_write", "space",
                 "lo", "hi", "block", "prev_block", "reused", "prev_loc", "cur_loc")

    def __init__(self, kind, fp, previous, current, prev_write, cur_write, space, lo, hi, block, prev_block,
                 prev_loc, cur_loc):
        self.kind = kind
        self.fingerprint = fp
        self.count = 1
        self.previous = previous
        self.current = current
        self.prev_write = prev_write
        self.cur_write = cur_write
        self.space = space
        self.lo = lo
        self.hi = hi
        self.block = block
        self.prev_block = prev_block
        self.reused = False
        self.prev_loc = prev_loc
        self.cur_loc = cur_loc

    def __repr__(self) -> str:
        return (f"Finding({self.kind}, {self.prev_loc} -> {self.cur_loc}, agents {self.previous.agent}->"
                f"{self.current.agent}, x{self.count})")


class Occurrence(NamedTuple):
    """One detected hazard instance (kept with ``keep_occurrences=True``, for tests and the oracle). ``kind`` is the
    race's class: a reuse race with an unreporting allocator's allocation is ``alloc-reuse`` here and a
    missing-record-stream finding (:meth:`FindingLog.race`)."""

    kind: str
    space: int
    lo: int
    hi: int
    prev_seq: int
    cur_seq: int
    folded: bool


def _fold_access(acc, block, f: Finding) -> None:
    """Mark acc's later races on ``block``'s bytes as part of the missing-record-stream finding f (one mark per
    block)."""
    if acc.mrs is None:
        acc.mrs = [(block, f)]
    elif all(b is not block for b, _f in acc.mrs):
        acc.mrs.append((block, f))


class FindingLog:
    """The findings by fingerprint (``findings``), and the occurrences with ``keep_occurrences``.

    ``stacks``: the analysis's stack table (id -> frames), which names an access's location.
    """

    def __init__(self, stacks: dict, keep_occurrences: bool = False):
        self.stacks = stacks
        self.findings: dict[str, Finding] = {}
        self.keep_occurrences = keep_occurrences
        self.occurrences: list[Occurrence] = []
        self._loc_cache: dict[int, str] = {}
        # (the access whose races are being reported, {id(earlier access): (it, the finding it made or None)}): the
        # fragments of one pair of accesses count once
        self._last_race = None

    def location_of(self, access) -> str:
        loc = self._loc_cache.get(access.stack)
        if loc is None:
            loc = location(self.stacks.get(access.stack, ()), "")
            self._loc_cache[access.stack] = loc
        return loc or f"op:{access.name}"

    def stack_redefined(self, stack: int) -> None:
        self._loc_cache.pop(stack, None)

    def race(self, prev, prev_write: bool, cur, cur_write: bool, seg, space: int) -> None:
        """prev and cur race on the shadow range seg of ``space``."""
        blk = seg.block
        old = blk is not None and prev.seq < blk.seq  # prev was made in an earlier life of this memory
        mrs = None
        if old and prev.mrs is not None:  # folded into a missing record_stream finding (fold_into)?
            for b, f in prev.mrs:
                if b.space == space and b.start <= seg.start and seg.end <= b.end:
                    mrs = f
                    break
        if old:
            kind = ALLOC_REUSE
        elif prev.agent == HOST or cur.agent == HOST:
            kind = HOST_DEVICE
        else:
            kind = DEVICE_DEVICE
        if self.keep_occurrences:
            self.occurrences.append(Occurrence(kind, space, seg.start, seg.end, prev.seq, cur.seq, mrs is not None))
        if mrs is not None:
            mrs.reused = True
            return
        last = self._last_race
        if last is not None and last[0] is cur:
            pairs = last[1]
            seen = pairs.get(id(prev))
            if seen is not None:
                f = seen[1]  # the same pair of ops on another fragment of the range: one occurrence
                if f is not None and f.space == space and f.hi == seg.start:
                    f.hi = seg.end  # (a finding's memory is its first occurrence's)
                return
        else:
            pairs = {}  # id(prev) -> (prev, the finding it made, or None if it counted an old one)
            self._last_race = (cur, pairs)
        unreported = old and blk.pool == E.UNREPORTED_POOL
        if unreported:
            # Only the allocation races with an earlier life there, and only with accesses of streams that were
            # neither the old block's owner nor recorded on it (the unreporting allocator's survival rule): a
            # missing record_stream.
            kind = MISSING_RECORD_STREAM
        lp, lc = self.location_of(prev), self.location_of(cur)
        fp = fingerprint(kind, lp, lc)
        f = self.findings.get(fp)
        if f is not None:
            f.count += 1
            pairs[id(prev)] = (prev, None)
            return
        f = self.findings[fp] = Finding(kind, fp, prev, cur, prev_write, cur_write, space, seg.start, seg.end,
                                        blk, seg.prev_block if old else None, lp, lc)
        f.reused = unreported
        pairs[id(prev)] = (prev, f)

    def missing_record_stream(self, x, old, cur, new_block) -> Finding:
        """The foreign access x to the freed block ``old`` was still unordered with ``cur``, the allocation of its
        owner that could get the block (``new_block``: the block it did get, where it covers old's bytes)."""
        if self.keep_occurrences:
            self.occurrences.append(Occurrence(MISSING_RECORD_STREAM, old.space, old.start, old.end, x.seq,
                                               cur.seq, False))
        lp, lc = self.location_of(x), self.location_of(cur)
        fp = fingerprint(MISSING_RECORD_STREAM, lp, lc)
        f = self.findings.get(fp)
        if f is not None:
            f.count += 1
            return f
        prev_write = bool(x.ranges_on(old.start, old.end, True))
        f = Finding(MISSING_RECORD_STREAM, fp, x, cur, prev_write, True, old.space, old.start, old.end,
                    new_block, old, lp, lc)
        self.findings[fp] = f
        return f

    @staticmethod
    def fold_into(f: Finding, old, x, shadow: dict) -> None:
        """Races of x, and of every earlier access of x's stream to ``old`` during its life, with later lives of
        old's bytes are f's consequences from now on, not findings of their own (docs/semantics.md). Marks x and
        those of the stream's accesses the shadow memory still holds on old's bytes (only they can race there
        later)."""
        _fold_access(x, old, f)
        sh = shadow.get(old.space)
        if sh is None:
            return
        g, first, until = x.agent, old.seq, old.freed_at
        for seg in sh.overlapping(old.start, old.end):
            for acc in seg.accesses():
                if acc.agent == g and first <= acc.seq < until:  # in old's life
                    _fold_access(acc, old, f)

    def merge(self, other: FindingLog, block_at) -> None:
        """Add the findings of another analysis (a captured graph's), each named with ``block_at(space, lo)``, the
        memory block now at its place; one already here counts the other's occurrences."""
        for fp, f in other.findings.items():
            mine = self.findings.get(fp)
            if mine is not None:
                mine.count += f.count
                continue
            f.block = block_at(f.space, f.lo)
            self.findings[fp] = f

    def sorted(self) -> list[Finding]:
        """The findings in the order of their accesses."""
        return sorted(self.findings.values(), key=lambda f: (f.previous.seq, f.current.seq))
