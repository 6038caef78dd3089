"""The analyzer: takes events in trace order, hands each to the part of the analysis it concerns, and collects
deduplicated findings.

Synchronization goes to the clocks (:mod:`.clocks`), an op's accesses to the race rule (:mod:`.race`), allocations,
frees and ``record_stream`` to the lives of memory (:mod:`.lifetimes`); races become findings in :mod:`.findings`.
The analyzer itself keeps the stack, context and note tables, the counters, and retires history nothing can race
with any more. The contract it implements is ``docs/semantics.md``. Imports nothing of torch or cupy.
"""

from __future__ import annotations

from .. import events as E
from .allocator import AllocatorModel
from .clocks import Clocks
from .findings import Finding, FindingLog
from .lifetimes import Lifetimes
from .race import ShadowChecker
from .shadow import Access, ShadowSpace, UnrecordedAccess

HOST = E.HOST

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
    """Consumes events (:meth:`feed`) and collects deduplicated :attr:`findings` (fingerprint -> Finding).

    ``keep_occurrences``: also list every hazard instance in :attr:`occurrences`. History is retired every
    ``retire_every`` events (and at host synchronizations past that point); ``max_dead_history`` bounds the shadow
    ranges of freed memory kept for a program whose host never synchronizes.
    """

    def __init__(self, keep_occurrences: bool = False, retire_every: int = 1 << 16,
                 max_dead_history: int = 1 << 18):
        self.clocks = Clocks()
        self.agents = self.clocks.agents
        self.shadow: dict[int, ShadowSpace] = {}
        self.allocator = AllocatorModel()
        self.stacks: dict[int, tuple] = {0: ()}
        self.contexts: dict[int, str] = {0: ""}
        self.log = FindingLog(self.stacks, keep_occurrences)
        self.findings = self.log.findings
        self.occurrences = self.log.occurrences
        self.keep_occurrences = keep_occurrences
        self.notes: list[tuple[str, str]] = []
        self.seq = 0
        self.counts = {"ops": 0, "host_accesses": 0, "syncs": 0, "allocs": 0, "frees": 0}
        self.checker = ShadowChecker(self.shadow, self.clocks, self.log)
        self.lifetimes = Lifetimes(self.allocator, self.shadow, self.clocks, self.checker, self.log, self.counts,
                                   self.note, self._ensure_agent)
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
            E.ALLOC: self.lifetimes.alloc,
            E.FREE: self.lifetimes.free,
            E.RECORD_STREAM: self.lifetimes.record_stream,
            E.LABEL: self.lifetimes.label,
            E.EVENT_DELETE: self._event_delete,
            E.NOTE: self._note_event,
            E.GRAPH: self._graph,
            E.RELEASE: self.lifetimes.release,
        }

    # ------------------------------------------------------------------ feeding
    def feed(self, events) -> None:
        """Apply events in order. Each handler gets the event and ``seq``, its index in the trace."""
        handlers = self._handlers
        op = self._op
        OP = E.OP
        seq = self.seq
        try:
            for ev in events:
                if ev[0] == OP:
                    op(ev, seq)
                else:
                    handlers[ev[0]](ev, seq)
                seq += 1
        finally:
            self.seq = seq
        if seq >= self._next_retire:
            self.retire()

    def finish(self) -> None:
        """Called once after the last event; nothing is pending at the end of a trace (an owner that never
        allocates again cannot reuse its freed blocks)."""

    def note(self, level: str, text: str) -> None:
        """Add a note to the report (once)."""
        item = (level, text)
        if item not in self.notes:
            self.notes.append(item)

    # ------------------------------------------------------------------ definitions
    def _def_stack(self, ev, _seq: int) -> None:
        self.stacks[ev[1]] = tuple(tuple(f) for f in ev[2])
        self.log.stack_redefined(ev[1])

    def _def_context(self, ev, _seq: int) -> None:
        self.contexts[ev[1]] = ev[2]

    def _stream(self, ev, _seq: int) -> None:
        _, agent, device, handle, flags, name = ev
        if agent == HOST:
            return
        self.clocks.declare(agent, device, handle, flags, name)

    def _ensure_agent(self, agent: int) -> None:
        if agent not in self.agents:
            self.note("warning", f"stream agent {agent} used before it was declared")
            self.clocks.declare(agent, -1, 0, 0, "")

    def _note_event(self, ev, _seq: int) -> None:
        self.note(ev[1], ev[2])

    # ------------------------------------------------------------------ synchronization
    def _host_synced(self, seq: int) -> None:
        """The host learned a clock at event seq: count the sync; history may be retired now."""
        self.counts["syncs"] += 1
        if seq >= self._next_retire:
            self.seq = seq
            self.retire()

    def _event_record(self, ev, _seq: int) -> None:
        _, event, a, _stack = ev
        self._ensure_agent(a)
        self.clocks.event_record(event, a)

    def _event_wait(self, ev, _seq: int) -> None:
        _, event, a, _stack = ev
        self._ensure_agent(a)
        self.clocks.event_wait(event, a)

    def _event_delete(self, ev, _seq: int) -> None:
        self.clocks.event_delete(ev[1])

    def _stream_sync(self, ev, seq: int) -> None:
        a = ev[1]
        self._ensure_agent(a)
        self.clocks.host_waits_for(a)
        self._host_synced(seq)

    def _event_sync(self, ev, seq: int) -> None:
        if self.clocks.event_sync(ev[1]):
            self._host_synced(seq)

    def _device_sync(self, ev, seq: int) -> None:
        self.clocks.device_sync(ev[1])
        self._host_synced(seq)

    # ------------------------------------------------------------------ operations
    def _op(self, ev, seq: int) -> None:
        _, a, name, reads, writes, stack, ctx, flags = ev
        clocks = self.clocks
        if a == HOST:
            t = clocks.host_access()
            self.counts["host_accesses"] += 1
        else:
            try:
                t = clocks.enqueue(a)
            except IndexError:
                self._ensure_agent(a)
                t = clocks.enqueue(a)
            self.counts["ops"] += 1
        if writes or reads:
            acc = (UnrecordedAccess if flags & E.OP_UNRECORDED else Access)(a, t[a], seq, name, stack, ctx, reads,
                                                                             writes)
            checker = self.checker
            for r in writes:
                if r[2] > 0:
                    checker.write(r, acc, t)
            for r in reads:
                if r[2] > 0 and r not in writes:
                    checker.read(r, acc, t)
        if flags & E.OP_BLOCKING and a != HOST:
            clocks.host_waits_for(a)
            self._host_synced(seq)

    def _graph(self, ev, seq: int) -> None:
        """The nodes of one captured CUDA graph: checked against each other only, by an analysis of their own (the
        graph's dependencies are the capture's stream order and event edges; the program's order around the graph
        is its replays' business). Its findings, races inside the graph, join this analysis's, each named with
        the memory block now at its place."""
        sub = Analyzer()
        sub.stacks = sub.log.stacks = self.stacks  # (its nodes name this analysis's stacks and contexts)
        sub.contexts = self.contexts
        for a, info in self.agents.items():
            if a != HOST:
                sub.clocks.declare(a, info.device, info.handle, info.flags, info.name)
        handlers = sub._handlers
        for node in ev[1]:
            handlers[node[0]](node, seq)
        self.log.merge(sub.log, self.lifetimes.block_at)
        for level, text in sub.notes:
            self.note(level, text)

    # ------------------------------------------------------------------ retirement
    def retire(self) -> None:
        """Forget accesses the host has synchronized past and empty history of dead memory. A program that never
        lets the host synchronize keeps the history of its freed memory: past ``max_dead_history`` ranges, the
        oldest of it is forgotten (and a note says so)."""
        self._next_retire = self.seq + self._retire_every
        h = self.clocks.vc[HOST]
        kept_dead = []
        for sh in self.shadow.values():
            dead = []
            for seg in sh:
                seg.forget_known(h)
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
            self.note("warning", "the host never synchronized: the oldest history of freed memory was "
                                 "forgotten to bound memory (races with it can be missed)")

    # ------------------------------------------------------------------ results
    def shadow_size(self) -> int:
        return sum(len(s) for s in self.shadow.values())

    def sorted_findings(self) -> list[Finding]:
        return self.log.sorted()
