"""A brute-force reference implementation of docs/semantics.md, for the property test.

It builds the happens-before graph explicitly (one node per event an agent performs, edges as in the spec's
table, plus the allocator's deferred-reuse edges), computes reachability over it (a transitive closure, no
clocks), and then checks every conflicting pair of accesses byte by byte. It is meant to be obviously correct,
not fast: traces of a few dozen events with a few hundred bytes of memory.

Readings of docs/semantics.md where the text leaves room (the most literal one is used):

* ALLOC, FREE, RECORD_STREAM, LABEL, ... are not nodes. (It does not matter: a host node with no incoming
  edge but program order would change no reachability.)
* "Recorded users" of a block are the streams other than its owner named by RECORD_STREAM on it during its
  life (the caching allocator ignores uses on the allocation stream). So a new life's accesses are not ordered
  after the owner's old accesses by the deferred-reuse edge (only by the graph: program order, events, syncs).
* The deferred-reuse edge orders only the pair (X, Y) on the reused bytes; it is not a graph edge, so it does
  not order X before other memory that Y's agent touches later (docs/semantics.md: the allocator's waiting
  makes no program-visible ordering). ``Oracle(events, reuse_edges="graph")`` is the transitive reading.
* An allocation covering bytes of a freed block gets the edge from every earlier life of those bytes (an
  older life's edges already reach every access after the first reuse, so this is the same as "the freed
  block b").
* "Missing record_stream": the first ALLOC with owner A from b's memory pool after b's free, in any space
  (owners are streams of one device, so in practice the device of b). "G's last access to b" = the last OP of G
  (a stream) touching any byte of b during b's life. "Does not happen-before the allocation point" = reaches
  neither A's latest node nor the host's latest node at that ALLOC (graph edges, the reuse edges included).
* Folding: a race (X, Y) on a byte of a freed block b is folded when X is the foreign access of a
  missing-record-stream finding for b at ALLOC a, or an earlier access of the same stream to b in b's life, Y's
  access of the byte belongs to a later life of b's bytes, and Y comes after a (the finding is known by then)
  (``fold="later-lives"``, the spec's reading; ``fold="new-life"`` folds only races with the life a started,
  when a covers bytes of b).
* An allocator that reports no frees (ALLOC pool ``E.UNREPORTED_POOL``): such an ALLOC a is work enqueued on its
  owner B (a node) that writes every byte it covers (an access, ``allocation``), and ends, on each of those bytes,
  the life L there just before (its block leaves the live set whole, as the generator never touches the rest
  again). An access x of that byte made before a is ordered before a and every later access of the byte (pairs)
  if no block held the byte, or if x reaches the latest node (at a) of the host, of L's owner or of a recorded user
  of L. Other accesses keep the graph's order.
* Memory handed back to the driver: at a RELEASE of a range, and at an ALLOC (of a device pool >= 0) on each byte
  whose latest life was a block of another owner or of another pool (>= 0), every access of that byte before it
  is ordered before every access of the byte after it (pairs, in either reading of the deferred-reuse edges), and
  the freed blocks with bytes in the RELEASE's range (at such an ALLOC: those earlier lives' blocks) leave the
  pending lists of the missing-record-stream check.
* EVENT_DELETE is not in the spec's edge table; the oracle ignores it (the generator never emits it).
* The life of an access to a byte is the latest ALLOC covering that byte (accesses to freed or never
  allocated memory are out of scope; the generator never makes them).
"""

from __future__ import annotations

from collections import defaultdict, namedtuple
from itertools import product

from streamsan import events as E

Access = namedtuple("Access", "seq node agent write life unrecorded", defaults=(False,))
Block = namedtuple("Block", "id space start size owner pool")  # id = seq of the ALLOC


def range_bytes(r):
    """The byte addresses a range touches (a dense range: all of [start, start+size))."""
    space, start, size = r[0], r[1], r[2]
    lay = r[3] if len(r) > 3 else None
    if lay is None:
        return space, set(range(start, start + size))
    itemsize, sizes, strides = lay
    out = set()
    for idx in product(*(range(s) for s in sizes)):
        off = start + itemsize * sum(i * st for i, st in zip(idx, strides))
        out.update(b for b in range(off, off + itemsize) if start <= b < start + size)
    return space, out


class Oracle:
    """Decides races and missing-record-stream findings of one event sequence.

    Results:
      race_pairs:   set of (space, byte, xseq, yseq) for every racing pair (xseq < yseq, OP event indices)
      racing_bytes: set of (space, byte) with at least one racing pair
      mrs:          set of (xseq, alloc_seq) missing-record-stream findings
    Queries: hb(xseq, yseq), is_race(xseq, yseq, space, byte), classify(xseq, yseq, space, byte).
    """

    def __init__(self, events, reuse_edges="pair", fold="later-lives"):
        assert reuse_edges in ("graph", "pair") and fold in ("new-life", "later-lives")
        self.events = [tuple(ev) for ev in events]
        self.reuse_edges = reuse_edges
        self.fold = fold
        # graph
        self.node_agent = []
        self.succ = []  # node -> set of successor nodes
        self.latest = {}  # agent -> its latest node
        self.op_node = {}  # seq of an OP -> its node
        # memory
        self.acc = defaultdict(list)  # (space, byte) -> [Access] in trace order
        self.op_access = {}  # seq -> {(space, byte): write}
        self.blocks = {}  # block id -> Block
        self.users = defaultdict(set)  # block id -> recorded users
        self.free_seq = {}  # block id -> seq of its FREE
        self.allocs = []  # (seq, Block)
        self.unreported_ends = []  # (seq of an unreporting allocator's ALLOC, space, {byte: life it ended})
        self.driver_ends = []  # (seq of a RELEASE or of an ALLOC that implies one, space, [bytes])
        self._build()
        self._add_reuse_edges()
        self._closure()
        self._unreported_reuse()
        self._driver_reuse()
        self._missing_record_stream()
        self._races()

    # ---------------------------------------------------------------- graph
    def _new_node(self, agent, preds=()):
        n = len(self.node_agent)
        self.node_agent.append(agent)
        self.succ.append(set())
        if agent in self.latest:  # program order
            self.succ[self.latest[agent]].add(n)
        for p in preds:
            self.succ[p].add(n)
        self.latest[agent] = n
        return n

    def _enqueue(self, s):
        """A new node of stream s for work enqueued on it, with the enqueue and legacy/blocking edges."""
        preds = []
        if E.HOST in self.latest:
            preds.append(self.latest[E.HOST])
        dev, flags = self.streams[s]
        for b, (bdev, bflags) in self.streams.items():
            if bdev != dev or b == s or b not in self.latest:
                continue
            if flags & E.LEGACY_DEFAULT and bflags & E.BLOCKING:
                preds.append(self.latest[b])
            if flags & E.BLOCKING and bflags & E.LEGACY_DEFAULT:
                preds.append(self.latest[b])
        return self._new_node(s, preds)

    def _build(self):
        self.streams = {}  # agent -> (device, flags)
        ev_node = {}  # event id -> node it denotes
        live = {}  # (space, start) -> Block
        life = {}  # (space, byte) -> block id of the latest ALLOC covering it
        self.alloc_points = []  # (alloc seq, owner, A's latest node, host's latest node, [freed blocks to check])
        pending = defaultdict(list)  # (owner, pool) -> freed device blocks not yet checked
        for seq, ev in enumerate(self.events):
            k = ev[0]
            if k == E.STREAM:
                self.streams[ev[1]] = (ev[2], ev[4])
            elif k == E.EVENT_RECORD:
                ev_node[ev[1]] = self._enqueue(ev[2])
            elif k == E.EVENT_WAIT:
                src = ev_node.get(ev[1])
                n = self._enqueue(ev[2])
                if src is not None:
                    self.succ[src].add(n)
            elif k == E.STREAM_SYNC:
                self._new_node(E.HOST, [self.latest[ev[1]]] if ev[1] in self.latest else [])
            elif k == E.EVENT_SYNC:
                self._new_node(E.HOST, [ev_node[ev[1]]] if ev[1] in ev_node else [])
            elif k == E.DEVICE_SYNC:
                self._new_node(E.HOST, [self.latest[s] for s, (d, _f) in self.streams.items()
                                        if d == ev[1] and s in self.latest])
            elif k == E.OP:
                agent, reads, writes, flags = ev[1], ev[3], ev[4], ev[7]
                n = self._new_node(E.HOST) if agent == E.HOST else self._enqueue(agent)
                self.op_node[seq] = n
                touched = {}
                for r in reads:
                    sp, bs = range_bytes(r)
                    for b in bs:
                        touched.setdefault((sp, b), False)
                for r in writes:
                    sp, bs = range_bytes(r)
                    for b in bs:
                        touched[(sp, b)] = True
                self.op_access[seq] = touched
                unrecorded = bool(flags & E.OP_UNRECORDED)
                for loc, w in touched.items():
                    self.acc[loc].append(Access(seq, n, agent, w, life.get(loc), unrecorded))
                if flags & E.OP_BLOCKING:
                    self._new_node(E.HOST, [n])
            elif k == E.ALLOC:
                blk = Block(seq, ev[1], ev[2], ev[3], ev[4], ev[8] if len(ev) > 8 else 0)
                self.blocks[seq] = blk
                if blk.space != E.PINNED and blk.pool >= 0:
                    moved, olds = [], set()
                    for b in range(blk.start, blk.start + blk.size):
                        old = life.get((blk.space, b))
                        ob = self.blocks[old] if old is not None else None
                        if ob is not None and ob.pool >= 0 and (ob.owner != blk.owner or ob.pool != blk.pool):
                            moved.append(b)
                            olds.add(ob)
                    if moved:
                        self.driver_ends.append((seq, blk.space, moved))
                        for key in pending:
                            pending[key] = [b for b in pending[key] if b not in olds]
                if blk.pool == E.UNREPORTED_POOL:
                    ended = {b: life.get((blk.space, b)) for b in range(blk.start, blk.start + blk.size)}
                    handing = {old: [self.latest[g] for g in {self.blocks[old].owner} | self.users[old]
                                     if g in self.latest] for old in set(ended.values()) if old is not None}
                    self.unreported_ends.append((seq, blk.space, ended, handing, self.latest.get(E.HOST)))
                    n = self.op_node[seq] = self._enqueue(blk.owner)
                    for b, old in ended.items():
                        if old is not None:  # (fresh bytes: no earlier life, no allocation write)
                            self.acc[(blk.space, b)].append(Access(seq, n, blk.owner, True, seq))
                    end = blk.start + blk.size
                    for key, old in list(live.items()):
                        if old.space == blk.space and old.start < end and blk.start < old.start + old.size:
                            del live[key]
                live[(blk.space, blk.start)] = blk
                for b in range(blk.start, blk.start + blk.size):
                    life[(blk.space, b)] = seq
                self.allocs.append((seq, blk))
                owner = blk.owner
                self.alloc_points.append((seq, owner, self.latest.get(owner), self.latest.get(E.HOST),
                                          pending.pop((owner, blk.pool), [])))
            elif k == E.FREE:
                blk = live.pop((ev[1], ev[2]))
                self.free_seq[blk.id] = seq
                if blk.space != E.PINNED:
                    pending[(blk.owner, blk.pool)].append(blk)
            elif k == E.RELEASE:
                space, lo, hi = ev[1], ev[2], ev[2] + ev[3]
                self.driver_ends.append((seq, space, list(range(lo, hi))))
                for key in pending:
                    pending[key] = [b for b in pending[key]
                                    if not (b.space == space and b.start < hi and lo < b.start + b.size)]
            elif k == E.RECORD_STREAM:
                blk = live[(ev[1], ev[2])]
                if ev[3] != blk.owner:  # the caching allocator ignores uses on the allocation stream
                    self.users[blk.id].add(ev[3])
            # DEF_STACK, DEF_CONTEXT, LABEL, EVENT_DELETE, NOTE: nothing

    def _reuse_ordered(self, x, a_seq, loc):
        """Whether the deferred-reuse edge of the ALLOC at a_seq starts at access x (of a byte it covers)."""
        if x.life is None or x.seq > a_seq:
            return False
        blk = self.blocks[x.life]
        if self.free_seq.get(blk.id, a_seq + 1) > a_seq:  # that life has not ended by this ALLOC
            return False
        if blk.space == E.PINNED:  # (the pinned allocator waits for the accesses it recorded events for)
            if x.agent == E.HOST:
                return False
            if not x.unrecorded:
                return True
            # an unrecorded access: ordered by a later access of its stream there that the allocator recorded
            return any(z.agent == x.agent and not z.unrecorded and x.seq < z.seq < a_seq
                       for z in self.acc.get(loc, ()))
        return x.agent in self.users[blk.id]

    def _add_reuse_edges(self):
        self.reuse_pairs = set()  # (space, byte, xseq, yseq) ordered by an allocator edge
        for a_seq, blk in self.allocs:
            for b in range(blk.start, blk.start + blk.size):
                accs = self.acc.get((blk.space, b), [])
                for x in accs:
                    if not self._reuse_ordered(x, a_seq, (blk.space, b)):
                        continue
                    for y in accs:
                        if y.seq > a_seq:
                            self.reuse_pairs.add((blk.space, b, x.seq, y.seq))
                            if self.reuse_edges == "graph":
                                self.succ[x.node].add(y.node)

    def _unreported_reuse(self):
        """The pairs an unreporting allocator's ALLOCs order."""
        for a_seq, space, ended, handing, host in self.unreported_ends:
            for b, old in ended.items():
                accs = self.acc.get((space, b), [])
                later = [y.seq for y in accs if y.seq >= a_seq]  # (the ALLOC's own write first)
                for x in accs:
                    if x.seq >= a_seq:
                        break
                    seen_by = handing[old] + [host] if old is not None and host is not None else handing.get(old, [])
                    if old is None or any(self.reaches(x.node, n) for n in seen_by):
                        self.reuse_pairs.update((space, b, x.seq, ys) for ys in later)

    def _driver_reuse(self):
        """The pairs a release to the driver orders: every access of a byte before it, before every one after."""
        for r_seq, space, bs in self.driver_ends:
            for b in bs:
                accs = self.acc.get((space, b), [])
                self.reuse_pairs.update((space, b, x.seq, y.seq) for x in accs if x.seq < r_seq
                                        for y in accs if y.seq > r_seq)

    def _closure(self):
        """desc[n]: bitmask of the nodes reachable from n. Every edge goes forward in node order."""
        self.desc = [0] * len(self.succ)
        for n in range(len(self.succ) - 1, -1, -1):
            m = 0
            for s in self.succ[n]:
                assert s > n
                m |= self.desc[s] | (1 << s)
            self.desc[n] = m

    def reaches(self, a, b):
        """Node a happens-before (or is) node b."""
        return a == b or bool((self.desc[a] >> b) & 1)

    def hb(self, xseq, yseq):
        """The OP at xseq happens-before the OP at yseq in the graph."""
        return self.reaches(self.op_node[xseq], self.op_node[yseq])

    # ---------------------------------------------------------------- findings
    def _missing_record_stream(self):
        self.mrs = set()
        self.folded = set()  # (xseq, alloc seq of the new life, the freed block's space, start, end)
        for a_seq, owner, a_latest, h_latest, freed in self.alloc_points:
            new = self.blocks[a_seq]
            for b in freed:
                last = {}  # stream -> its last access node/seq to b during b's life
                seqs = {}  # stream -> the seqs of all its accesses to b during b's life
                for byte in range(b.start, b.start + b.size):
                    for x in self.acc.get((b.space, byte), []):
                        if x.life == b.id and x.agent != E.HOST:
                            seqs.setdefault(x.agent, set()).add(x.seq)
                            if x.agent not in last or x.seq > last[x.agent].seq:
                                last[x.agent] = x
                for g, x in last.items():
                    if g == b.owner or g in self.users[b.id]:
                        continue
                    ordered = any(p is not None and self.reaches(x.node, p) for p in (a_latest, h_latest))
                    if not ordered:
                        self.mrs.add((x.seq, a_seq))
                        covers = new.space == b.space and new.start < b.start + b.size and b.start < new.start + new.size
                        if covers or self.fold == "later-lives":
                            self.folded.update((xs, a_seq, b.space, b.start, b.start + b.size) for xs in seqs[g])

    def ordered(self, x, y, space, byte):
        """Access x (earlier) happens-before access y on that byte, allocator edges included."""
        if self.reaches(x.node, y.node):
            return True
        return self.reuse_edges == "pair" and (space, byte, x.seq, y.seq) in self.reuse_pairs

    def _races(self):
        self.race_pairs = set()
        self.racing_bytes = set()
        for (space, byte), accs in self.acc.items():
            for i, x in enumerate(accs):
                for y in accs[i + 1:]:
                    if x.agent == y.agent or not (x.write or y.write):
                        continue
                    if not self.ordered(x, y, space, byte):
                        self.race_pairs.add((space, byte, x.seq, y.seq))
                        self.racing_bytes.add((space, byte))

    # ---------------------------------------------------------------- queries
    def _access(self, seq, space, byte):
        for a in self.acc.get((space, byte), []):
            if a.seq == seq:
                return a
        return None

    def conflicts(self, xseq, yseq, space, byte):
        x, y = self._access(xseq, space, byte), self._access(yseq, space, byte)
        return (x is not None and y is not None and xseq < yseq and x.agent != y.agent
                and (x.write or y.write))

    def is_race(self, xseq, yseq, space, byte):
        return (space, byte, xseq, yseq) in self.race_pairs

    def classify(self, xseq, yseq, space, byte):
        """(kind, folded) of the pair (xseq, yseq) on that byte."""
        x, y = self._access(xseq, space, byte), self._access(yseq, space, byte)
        if x.life != y.life:
            if self.fold == "new-life":
                return "alloc-reuse", any(xs == x.seq and a == y.life and sp == space and lo <= byte < hi
                                          for xs, a, sp, lo, hi in self.folded)
            # (a <= y.seq: an unreporting allocator's ALLOC at a is itself a write there, part of the finding)
            return "alloc-reuse", any(xs == x.seq and a <= y.seq and sp == space and lo <= byte < hi
                                      for xs, a, sp, lo, hi in self.folded)
        if x.agent != E.HOST and y.agent != E.HOST:
            return "device-device", False
        return "host-device", False


def format_trace(events):
    """One numbered line per event, for failure messages."""
    lines = []
    for i, ev in enumerate(events):
        name = E.KIND_NAMES[ev[0]] if 0 <= ev[0] < len(E.KIND_NAMES) else str(ev[0])
        if ev[0] == E.OP:
            fl = " BLOCKING" if ev[7] & E.OP_BLOCKING else ""
            rest = f"agent={ev[1]} reads={list(ev[3])} writes={list(ev[4])}{fl}"
        else:
            rest = " ".join(repr(f) for f in ev[1:])
        lines.append(f"{i:3d} {name} {rest}")
    return "\n".join(lines)
