"""The analyzer: applies events to vector clocks, shadow memory and the allocator model, and emits findings.

The race rule lives here (:meth:`Analyzer._write`, :meth:`Analyzer._read`, :meth:`Analyzer._alloc`); the
contract it implements is ``docs/semantics.md``. Imports nothing of torch or cupy.

Clocks (FastTrack-style): every agent has a vector clock ``vc[agent]`` (a list indexed by agent id). A stream's
own component ticks only when its clock is published (event record, a host sync on it, an implicit
legacy-default-stream edge), so consecutive ops on a stream share an epoch. The host publishes its clock on
every enqueue; it ticks lazily, before its next own access, and every stream remembers the host clock
generation it last joined, so an op costs no clock join unless the host learned something new.
"""

from __future__ import annotations

from typing import NamedTuple

from . import events as E
from .allocator import AllocatorModel, Block
from .findings import (ALLOC_REUSE, DEVICE_DEVICE, HOST_DEVICE, MISSING_RECORD_STREAM, Finding, fingerprint,
                       location)
from .layout import touch_common_bytes
from .shadow import Access, ShadowSpace

HOST = E.HOST
PINNED = E.PINNED
MAX_STRIDED_STATE = 64  # distinct strided views kept per shadow range before forgetting


class Occurrence(NamedTuple):
    """One detected hazard instance (kept with ``keep_occurrences=True``, for tests and the oracle). ``kind`` is the
    race's class: a reuse race with an unreporting allocator's allocation is ``alloc-reuse`` here and a
    missing-record-stream finding (``Analyzer._race``)."""

    kind: str
    space: int
    lo: int
    hi: int
    prev_seq: int
    cur_seq: int
    folded: bool


class AgentInfo:
    """A host or stream agent as declared by the tracer."""

    __slots__ = ("agent", "device", "handle", "flags", "name")

    def __init__(self, agent, device, handle, flags, name):
        self.agent = agent
        self.device = device
        self.handle = handle
        self.flags = flags
        self.name = name

    def __repr__(self) -> str:
        return f"AgentInfo({self.agent}, dev={self.device}, handle={self.handle:#x}, {self.name!r})"


def _join(dst: list, src: list) -> None:
    if len(src) == len(dst):
        dst[:] = map(max, dst, src)
    else:
        for i, v in enumerate(src):
            if v > dst[i]:
                dst[i] = v


def _conflict(prev: Access, prev_write: bool, cur_range, lo: int, hi: int) -> bool:
    """Whether prev (an access of the given type) and cur_range touch a common byte (strided views)."""
    for pr in prev.ranges_on(lo, hi, prev_write):
        if touch_common_bytes(pr, cur_range):
            return True
    return False


def _never(_access) -> bool:
    return False


def _survives(x: Access, h: list, old_block, space: int) -> bool:
    """Whether an access of an earlier life stays in the shadow when its memory is allocated again: not if
    the host synchronized past it, nor if the allocator waited for it (a recorded user's access in that
    block's own life; any stream's access of pinned memory)."""
    if x.clock <= h[x.agent]:
        return False
    if x.agent != HOST and (space == PINNED or (
            old_block is not None and x.agent in old_block.recorded and x.seq >= old_block.seq)):
        return False
    return True


def _survives_unreported(x: Access, h: list, old_block, vc: list) -> bool:
    """``_survives`` for an allocation from an allocator that reports no frees (``E.UNREPORTED_POOL``) over a block
    still live (docs/semantics.md): not if the host synchronized past it, nor if the block's owner or one of its
    recorded users had seen it by now (the driver orders the allocation after the owner's free, which PyTorch issues
    after those streams' work); accesses to memory no declared block holds (allocated before tracing began) are
    forgotten: nothing tells whose they were."""
    if old_block is None or x.clock <= h[x.agent] or x.clock <= vc[old_block.owner][x.agent]:
        return False
    for g in old_block.recorded:
        if x.clock <= vc[g][x.agent]:
            return False
    return True


def _fold_access(acc: Access, block: Block, f) -> None:
    """Mark acc's later races on ``block``'s bytes as part of the missing-record-stream finding f (one mark per
    block)."""
    if acc.mrs is None:
        acc.mrs = [(block, f)]
    elif all(b is not block for b, _f in acc.mrs):
        acc.mrs.append((block, f))


ANALYZER_ERROR = "analyzer error, some events were not analyzed"


def feed_guarded(analyzer, batch, problems: list) -> str | None:
    """Feed a batch without ever raising (the program must not break): an exception becomes one line in
    ``problems``, returned when it is new."""
    try:
        analyzer.feed(batch)
    except Exception as e:
        msg = f"{ANALYZER_ERROR}: {type(e).__name__}: {e}"
        if msg not in problems:
            problems.append(msg)
            return msg
    return None


class Analyzer:
    """Consumes events (:meth:`feed`) and collects deduplicated :attr:`findings`."""

    def __init__(self, keep_occurrences: bool = False, retire_every: int = 1 << 16,
                 max_dead_history: int = 1 << 18):
        self.vc: list[list[int]] = [[1]]
        self.agents: dict[int, AgentInfo] = {HOST: AgentInfo(HOST, -1, 0, 0, "host")}
        self.events: dict[int, list[int]] = {}
        self.host_gen = 1
        self.joined_gen: list[int] = [0]
        self.host_published = False
        self.implicit: list[list[int]] = [[]]
        self.shadow: dict[int, ShadowSpace] = {}
        self.allocator = AllocatorModel()
        self.stacks: dict[int, tuple] = {0: ()}
        self.contexts: dict[int, str] = {0: ""}
        self._loc_cache: dict[int, str] = {}
        self.findings: dict[str, Finding] = {}
        # (the access whose races are being reported, {id(earlier access): (it, the finding it made or None)}): the
        # fragments of one pair of accesses count once
        self._last_race = None
        self.keep_occurrences = keep_occurrences
        self.occurrences: list[Occurrence] = []
        self.notes: list[tuple[str, str]] = []
        self.seq = 0
        self.counts = {"ops": 0, "host_accesses": 0, "syncs": 0, "allocs": 0, "frees": 0}
        self._retire_every = retire_every
        self.max_dead_history = max_dead_history
        self._next_retire = retire_every
        self._handlers = {
            E.DEF_STACK: self._def_stack,
            E.DEF_CONTEXT: self._def_context,
            E.STREAM: self._stream,
            E.EVENT_RECORD: self._event_record,
            E.EVENT_WAIT: self._event_wait,
            E.STREAM_SYNC: self._stream_sync,
            E.EVENT_SYNC: self._event_sync,
            E.DEVICE_SYNC: self._device_sync,
            E.OP: self._op,
            E.ALLOC: self._alloc,
            E.FREE: self._free,
            E.RECORD_STREAM: self._record_stream,
            E.LABEL: self._label,
            E.EVENT_DELETE: self._event_delete,
            E.NOTE: self._note,
            E.GRAPH: self._graph,
        }

    # ------------------------------------------------------------------ feeding
    def feed(self, events) -> None:
        """Apply events in order."""
        handlers = self._handlers
        op = self._op
        OP = E.OP
        seq = self.seq
        try:
            for ev in events:
                self.seq = seq
                if ev[0] == OP:
                    op(ev)
                else:
                    handlers[ev[0]](ev)
                seq += 1
        finally:
            self.seq = seq
        if seq >= self._next_retire:
            self.retire()

    def finish(self) -> None:
        """Called once after the last event; nothing is pending at the end of a trace (an owner that never
        allocates again cannot reuse its freed blocks)."""

    # ------------------------------------------------------------------ agents and clocks
    def _declare(self, agent: int, device: int, handle: int, flags: int, name: str) -> None:
        info = self.agents.get(agent)
        if info is not None:
            info.device, info.handle, info.flags = device, handle, flags
            if name:
                info.name = name
            self._rebuild_implicit()
            return
        if not 0 < agent < E.MAX_AGENT:
            raise ValueError(f"agent id {agent} is outside [1, {E.MAX_AGENT})")
        self.agents[agent] = AgentInfo(agent, device, handle, flags, name)
        n = len(self.vc)
        if agent >= n:
            grow = agent + 1 - n
            for v in self.vc:
                v.extend([0] * grow)
            m = agent + 1
            self.vc.extend([0] * m for _ in range(grow))
            self.joined_gen.extend([0] * grow)
            self.implicit.extend([] for _ in range(grow))
        self.vc[agent][agent] = 1
        self._rebuild_implicit()

    def _rebuild_implicit(self) -> None:
        """Implicit edges between a device's legacy default stream and its blocking streams."""
        legacy: dict[int, int] = {}
        blocking: dict[int, list[int]] = {}
        for a, info in self.agents.items():
            if a == HOST:
                continue
            if info.flags & E.LEGACY_DEFAULT:
                legacy[info.device] = a
            elif info.flags & E.BLOCKING:
                blocking.setdefault(info.device, []).append(a)
        imp = [[] for _ in self.implicit]
        for dev, lg in legacy.items():
            bs = blocking.get(dev, [])
            imp[lg] = list(bs)
            for b in bs:
                imp[b] = [lg]
        self.implicit = imp

    def _ensure_agent(self, agent: int) -> None:
        if agent not in self.agents:
            self._note((E.NOTE, "warning", f"stream agent {agent} used before it was declared"))
            self._declare(agent, -1, 0, 0, "")

    def _enqueue(self, a: int) -> list:
        """Work is enqueued on stream a: it joins the host's clock (and implicit legacy-stream edges)."""
        vc = self.vc
        if self.joined_gen[a] != self.host_gen:
            _join(vc[a], vc[HOST])
            self.joined_gen[a] = self.host_gen
            self.host_published = True
        imp = self.implicit[a]
        if imp:
            t = vc[a]
            for b in imp:
                _join(t, vc[b])
                vc[b][b] += 1
        return vc[a]

    def _host_learns(self, clock: list) -> None:
        _join(self.vc[HOST], clock)
        self.host_gen += 1
        self.counts["syncs"] += 1
        if self.seq >= self._next_retire:
            self.retire()

    # ------------------------------------------------------------------ definitions
    def _def_stack(self, ev) -> None:
        self.stacks[ev[1]] = tuple(tuple(f) for f in ev[2])
        self._loc_cache.pop(ev[1], None)

    def _def_context(self, ev) -> None:
        self.contexts[ev[1]] = ev[2]

    def _stream(self, ev) -> None:
        _, agent, device, handle, flags, name = ev
        if agent == HOST:
            return
        self._declare(agent, device, handle, flags, name)

    def _note(self, ev) -> None:
        item = (ev[1], ev[2])
        if item not in self.notes:
            self.notes.append(item)

    # ------------------------------------------------------------------ synchronization
    def _event_record(self, ev) -> None:
        _, event, a, _stack = ev
        self._ensure_agent(a)
        t = self._enqueue(a)
        self.events[event] = t[:]
        t[a] += 1

    def _event_wait(self, ev) -> None:
        _, event, a, _stack = ev
        self._ensure_agent(a)
        t = self._enqueue(a)
        snap = self.events.get(event)
        if snap is not None:
            _join(t, snap)

    def _event_delete(self, ev) -> None:
        self.events.pop(ev[1], None)

    def _stream_sync(self, ev) -> None:
        a = ev[1]
        self._ensure_agent(a)
        t = self.vc[a]
        self._host_learns(t)
        t[a] += 1

    def _event_sync(self, ev) -> None:
        snap = self.events.get(ev[1])
        if snap is not None:
            self._host_learns(snap)

    def _device_sync(self, ev) -> None:
        dev = ev[1]
        vc = self.vc
        h = vc[HOST]
        for a, info in self.agents.items():
            if a != HOST and info.device == dev:
                _join(h, vc[a])
                vc[a][a] += 1
        self._host_learns(h)

    # ------------------------------------------------------------------ operations
    def _op(self, ev) -> None:
        _, a, name, reads, writes, stack, ctx, flags = ev
        vc = self.vc
        if a == HOST:
            if self.host_published:
                vc[HOST][HOST] += 1
                self.host_gen += 1
                self.host_published = False
            t = vc[HOST]
            self.counts["host_accesses"] += 1
        else:
            try:
                joined = self.joined_gen[a]
            except IndexError:
                self._ensure_agent(a)
                joined = self.joined_gen[a]
            if joined != self.host_gen:
                _join(vc[a], vc[HOST])
                self.joined_gen[a] = self.host_gen
                self.host_published = True
            if self.implicit[a]:
                self._enqueue(a)
            t = vc[a]
            self.counts["ops"] += 1
        if writes or reads:
            acc = Access(a, t[a], self.seq, name, stack, ctx, reads, writes)
            for r in writes:
                if r[2] > 0:
                    self._write(r, acc, t)
            for r in reads:
                if r[2] > 0 and r not in writes:
                    self._read(r, acc, t)
        if flags & E.OP_BLOCKING and a != HOST:
            self._host_learns(t)
            t[a] += 1

    def _graph(self, ev) -> None:
        """The nodes of one captured CUDA graph: checked against each other only, by an analysis of their own (the
        graph's dependencies are the capture's stream order and event edges; the program's order around the graph
        is its replays' business). Its findings, races inside the graph, join this analysis's, each named with
        the memory block now at its place."""
        sub = Analyzer()
        sub.stacks, sub.contexts = self.stacks, self.contexts
        for a, info in self.agents.items():
            if a != HOST:
                sub._declare(a, info.device, info.handle, info.flags, info.name)
        handlers = sub._handlers
        for node in ev[1]:
            sub.seq = self.seq
            handlers[node[0]](node)
        for fp, f in sub.findings.items():
            mine = self.findings.get(fp)
            if mine is not None:
                mine.count += f.count
                continue
            f.block = self._block_at(f.space, f.lo)
            self.findings[fp] = f
        for level, text in sub.notes:
            self._note((E.NOTE, level, text))

    def _space(self, space: int) -> ShadowSpace:
        sh = self.shadow.get(space)
        if sh is None:
            sh = self.shadow[space] = ShadowSpace()
        return sh

    def _write(self, r, acc: Access, t: list) -> None:
        """A write races with the last write and every read since that are not ordered before it."""
        a = acc.agent
        sh = self.shadow.get(r[0])
        if sh is None:
            sh = self._space(r[0])
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
                        if x.agent != a and x.clock > t[x.agent] and (
                                not (strided or x.strided) or _conflict(x, True, r, seg.start, seg.end)):
                            self._race(x, True, acc, True, seg, r[0])
                            raced = True
                elif w.agent != a and w.clock > t[w.agent] and (
                        not (strided or w.strided) or _conflict(w, True, r, seg.start, seg.end)):
                    self._race(w, True, acc, True, seg, r[0])
                    raced = True
            rd = seg.reads
            if rd is not None and not raced:
                if type(rd) is dict:  # (one read per stream: each unordered one is a race of its own)
                    for x in rd.values():
                        if x.agent != a and x.clock > t[x.agent] and (
                                not (strided or x.strided) or _conflict(x, False, r, seg.start, seg.end)):
                            self._race(x, False, acc, True, seg, r[0])
                elif rd.agent != a and rd.clock > t[rd.agent] and (
                        not (strided or rd.strided) or _conflict(rd, False, r, seg.start, seg.end)):
                    self._race(rd, False, acc, True, seg, r[0])
            if strided:
                # A strided write overwrites only its elements: keep what it may not have overwritten.
                if w is None:
                    seg.write = acc
                else:
                    kept = [x for x in (w if type(w) is list else (w,))
                            if x.ranges_on(seg.start, seg.end, True) != acc.ranges_on(seg.start, seg.end, True)]
                    kept.append(acc)
                    if len(kept) > MAX_STRIDED_STATE:
                        h = self.vc[HOST]
                        kept = [x for x in kept[:-1] if x.clock > h[x.agent]][-(MAX_STRIDED_STATE - 1):] + [acc]
                    seg.write = kept if len(kept) > 1 else acc
            else:
                seg.write = acc
                seg.reads = None
        if len(segs) > 1 and not strided:
            b0 = segs[0].block
            if all(s.block is b0 for s in segs):
                sh.merge(segs)

    def _read(self, r, acc: Access, t: list) -> None:
        """A read races with the last write if that write is not ordered before it."""
        a = acc.agent
        sh = self.shadow.get(r[0])
        if sh is None:
            sh = self._space(r[0])
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
                        if x.agent != a and x.clock > t[x.agent] and (
                                not (strided or x.strided) or _conflict(x, True, r, seg.start, seg.end)):
                            self._race(x, True, acc, False, seg, r[0])
                elif w.agent != a and w.clock > t[w.agent] and (
                        not (strided or w.strided) or _conflict(w, True, r, seg.start, seg.end)):
                    self._race(w, True, acc, False, seg, r[0])
            rd = seg.reads
            if not strided:
                if rd is None:
                    seg.reads = acc
                elif type(rd) is dict:
                    rd[a] = acc
                elif rd.agent == a or rd.clock <= t[rd.agent]:
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
                        h = self.vc[HOST]
                        for k in [k for k, x in rd.items() if x.clock <= h[x.agent]]:
                            del rd[k]
                        while len(rd) > MAX_STRIDED_STATE:  # beyond the bound: forget the oldest
                            del rd[next(iter(rd))]
                else:
                    seg.reads = {rd.agent: rd, key: acc}

    # ------------------------------------------------------------------ findings
    def _loc(self, access: Access) -> str:
        loc = self._loc_cache.get(access.stack)
        if loc is None:
            loc = location(self.stacks.get(access.stack, ()), "")
            self._loc_cache[access.stack] = loc
        return loc or f"op:{access.name}"

    def _race(self, prev: Access, prev_write: bool, cur: Access, cur_write: bool, seg, space: int) -> None:
        blk = seg.block
        old = blk is not None and prev.seq < blk.seq  # prev was made in an earlier life of this memory
        mrs = None
        if old and prev.mrs is not None:  # folded into a missing record_stream finding (_fold_into)?
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
            # neither the old block's owner nor recorded on it (_survives_unreported): a missing record_stream.
            kind = MISSING_RECORD_STREAM
        lp, lc = self._loc(prev), self._loc(cur)
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

    # ------------------------------------------------------------------ allocator
    def _alloc(self, ev) -> None:
        _, space, start, size, owner, stack, ctx, what = ev[:8]
        pool = ev[8] if len(ev) > 8 else 0
        self.counts["allocs"] += 1
        if owner != HOST and owner not in self.agents:
            self._ensure_agent(owner)
        end = start + size
        alloc = self.allocator
        blk = alloc.new_block(space, start, size, owner, stack, ctx, what, self.seq, pool)
        unreported = pool == E.UNREPORTED_POOL
        # (such an allocation is work on its stream: enqueued before the pending check, which it orders after)
        t = self._enqueue(owner) if unreported and owner != HOST else None
        pend = alloc.pending.pop((owner, pool), None) if alloc.pending and owner != HOST else None
        if pend:
            self._check_pending(pend, blk)
        if size <= 0:
            return
        sh = self.shadow.get(space)
        if sh is None:
            sh = self._space(space)
        seg = sh.ranges.get(start)
        if seg is not None and seg.end == end:
            segs = (seg,)
        elif sh.overlapping(start, end):
            segs = sh.cover(start, end)
        else:
            sh.cover(start, end)[0].block = blk
            return
        h = self.vc[HOST]
        earlier = [] if t is not None else None  # the ranges an unreporting allocator's allocation hands out again
        for seg in segs:
            ob = seg.block
            if ob is not None and not ob.freed:
                # Pinned frees are not observable, nor are an unreporting allocator's: a new block over a live one
                # ends the old life.
                if space != PINNED and not unreported:
                    self._note((E.NOTE, "warning", "an allocation overlapped live memory (a free was not seen)"))
                alloc.release(ob, _never)
            seg.prev_block = ob
            seg.block = blk
            if unreported:
                self._end_unreported_life(seg, ob, h)
                if ob is not None and earlier is not None:
                    if earlier and earlier[-1][1] == seg.start:
                        earlier[-1][1] = seg.end
                    else:
                        earlier.append([seg.start, seg.end])
                continue
            # The deferred-reuse edge: accesses the allocator waited for (recorded users' and, for pinned memory,
            # every stream's), and those the host has synchronized past, are ordered before the new life.
            w = seg.write
            if w is not None:
                if type(w) is list:
                    kept = [x for x in w if _survives(x, h, ob, space)]
                    seg.write = kept if len(kept) > 1 else (kept[0] if kept else None)
                elif w.clock <= h[w.agent] or (space == PINNED or (ob is not None and ob.recorded)) and not \
                        _survives(w, h, ob, space):
                    seg.write = None
            rd = seg.reads
            if rd is not None:
                if type(rd) is dict:
                    nd = {k: x for k, x in rd.items() if _survives(x, h, ob, space)}
                    seg.reads = nd or None
                elif rd.clock <= h[rd.agent] or (space == PINNED or (ob is not None and ob.recorded)) and not \
                        _survives(rd, h, ob, space):
                    seg.reads = None
        if earlier:
            self._allocation_write(space, earlier, owner, stack, ctx, t)

    def _allocation_write(self, space: int, earlier: list, owner: int, stack: int, ctx: int, t: list) -> None:
        """An unreporting allocator's allocation is stream-ordered work on its stream (cudaMallocAsync): a write,
        there and then, of the bytes it hands out again (``earlier``: [start, end) ranges a declared block held;
        ``t``: the stream's clock, the allocation enqueued). It races with the earlier life's accesses that
        ``_survives_unreported`` kept, and with later accesses of other streams not ordered after it. Fresh bytes get
        no such write: with no earlier life in the trace nothing can be pending there (the reporting allocator's
        rule too)."""
        rs = tuple((space, lo, hi - lo) for lo, hi in earlier)
        acc = Access(owner, t[owner], self.seq, "allocation", stack, ctx, (), rs)
        for r in rs:
            self._write(r, acc, t)

    def _end_unreported_life(self, seg, ob, h: list) -> None:
        """An unreporting allocator's allocation over a shadow range: only the accesses ``_survives_unreported``
        keeps stay."""
        vc = self.vc
        w, rd = seg.write, seg.reads
        if w is not None:
            kept = [x for x in (w if type(w) is list else (w,)) if _survives_unreported(x, h, ob, vc)]
            seg.write = kept if len(kept) > 1 else (kept[0] if kept else None)
        if type(rd) is dict:
            seg.reads = {k: x for k, x in rd.items() if _survives_unreported(x, h, ob, vc)} or None
        elif rd is not None and not _survives_unreported(rd, h, ob, vc):
            seg.reads = None

    def _check_pending(self, pend, blk: Block) -> None:
        """Missing record_stream: the owner's allocator may hand these freed blocks to ``blk``'s allocation."""
        owner = blk.owner
        own = self.vc[owner]
        h = self.vc[HOST]
        cur = Access(owner, own[owner], self.seq, "allocation", blk.stack, blk.ctx, (), ())
        for old, xs in pend:
            reused = old.space == blk.space and old.start < blk.end and blk.start < old.end
            for x in xs:
                if x.clock <= own[x.agent] or x.clock <= h[x.agent]:
                    continue
                f = self._missing_record_stream(x, old, cur, blk if reused else None)
                self._fold_into(f, old, x)
                if reused:
                    f.reused = True
                    if f.block is None:  # (first met where no block was handed on: this is the one that was)
                        f.block = blk

    def _fold_into(self, f: Finding, old: Block, x: Access) -> None:
        """Races of x, and of every earlier access of x's stream to ``old`` during its life, with later lives of
        old's bytes are f's consequences from now on, not findings of their own (docs/semantics.md). Marks x and
        those of the stream's accesses the shadow memory still holds on old's bytes (only they can race there
        later)."""
        _fold_access(x, old, f)
        sh = self.shadow.get(old.space)
        if sh is None:
            return
        g, first, until = x.agent, old.seq, old.freed_at
        for seg in sh.overlapping(old.start, old.end):
            for acc in seg.accesses():
                if acc.agent == g and first <= acc.seq < until:  # in old's life
                    _fold_access(acc, old, f)

    def _missing_record_stream(self, x: Access, old: Block, cur: Access, new_block) -> Finding:
        if self.keep_occurrences:
            self.occurrences.append(Occurrence(MISSING_RECORD_STREAM, old.space, old.start, old.end, x.seq,
                                               cur.seq, False))
        lp, lc = self._loc(x), self._loc(cur)
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

    def _free(self, ev) -> None:
        self.counts["frees"] += 1
        live = self.allocator.live.get(ev[1])
        blk = live.get(ev[2]) if live is not None else None
        if blk is None:
            return
        if not blk.foreign:
            blk.freed = True
            del live[ev[2]]
            return
        vc = self.vc
        own = vc[blk.owner]
        h = vc[HOST]
        blk.freed_at = self.seq
        self.allocator.release(blk, lambda x: x.clock > own[x.agent] and x.clock > h[x.agent])

    def _block_at(self, space: int, start: int):
        blk = self.allocator.live_block(space, start)
        if blk is None:
            sh = self.shadow.get(space)
            seg = sh.find(start) if sh is not None else None
            if seg is not None and seg.block is not None and not seg.block.freed:
                blk = seg.block
        return blk

    def _record_stream(self, ev) -> None:
        _, space, start, agent, _stack = ev
        blk = self._block_at(space, start)
        # (the allocator ignores uses on the allocation stream, and memory it did not allocate)
        if blk is not None and agent != blk.owner and blk.pool != E.FOREIGN_POOL:
            blk.recorded = blk.recorded | {agent}

    def _label(self, ev) -> None:
        _, space, start, _size, text = ev
        blk = self._block_at(space, start)
        if blk is not None:
            blk.label = text

    # ------------------------------------------------------------------ retirement
    def retire(self) -> None:
        """Forget accesses the host has synchronized past and empty history of dead memory. A program that never
        lets the host synchronize keeps the history of its freed memory: past ``max_dead_history`` ranges, the
        oldest of it is forgotten (and a note says so)."""
        self._next_retire = self.seq + self._retire_every
        h = self.vc[HOST]
        kept_dead = []
        for sh in self.shadow.values():
            dead = []
            for seg in sh:
                w = seg.write
                if w is not None:
                    if type(w) is list:
                        kept = [x for x in w if x.clock > h[x.agent]]
                        seg.write = kept if len(kept) > 1 else (kept[0] if kept else None)
                    elif w.clock <= h[w.agent]:
                        seg.write = None
                rd = seg.reads
                if rd is not None:
                    if type(rd) is dict:
                        nd = {k: x for k, x in rd.items() if x.clock > h[x.agent]}
                        seg.reads = nd or None
                    elif rd.clock <= h[rd.agent]:
                        seg.reads = None
                if seg.block is None or seg.block.freed:
                    if seg.write is None and seg.reads is None:
                        dead.append(seg)
                    else:
                        kept_dead.append((sh, seg))
            for seg in dead:
                sh.remove(seg)
        if len(kept_dead) > self.max_dead_history:
            kept_dead.sort(key=lambda item: max(x.seq for x in item[1].accesses()))
            drop = kept_dead[:len(kept_dead) - self.max_dead_history // 2]
            for sh, seg in drop:
                sh.remove(seg)
            self._note((E.NOTE, "warning", "the host never synchronized: the oldest history of freed memory was "
                                           "forgotten to bound memory (races with it can be missed)"))

    # ------------------------------------------------------------------ results
    def shadow_size(self) -> int:
        return sum(len(s) for s in self.shadow.values())

    def sorted_findings(self) -> list[Finding]:
        return sorted(self.findings.values(), key=lambda f: (f.previous.seq, f.current.seq))
