"""CUDA stream capture on CuPy streams: which streams capture into which graph, and what each capture holds.

A capture begins on one stream (its origin, ``Stream.begin_capture``). A stream that waits on an event recorded
on a capturing stream joins that capture (the fork of a fork-join capture), and captures from then until the
capture ends. While a stream captures, its calls and its event records and waits are nodes of the graph, in
capture order; nothing runs. The capture ends when its origin ends it (``end_capture``) and every stream leaves
it; it gives a graph only if that call succeeds: a capture that fails or was invalidated (an illegal call during
it, ``end_capture`` on a stream that joined it) runs nothing. What a graph does at each launch is
:mod:`streamsan.tracers.graphs`'s rule: one op on the launching stream over all the nodes' accesses, and the
nodes checked against each other once, with the capture's stream order and events as the graph's edges.
"""

from __future__ import annotations

from ... import events as E


class Capture:
    """One capture in progress: its origin stream's agent, the agents of the streams in it, its nodes (OP,
    EVENT_RECORD and EVENT_WAIT events), the ranges its calls read and wrote, and whether it was invalidated."""

    __slots__ = ("origin", "members", "nodes", "reads", "writes", "device", "invalid")

    def __init__(self, origin: int, device: int):
        self.origin = origin
        self.device = device
        self.members = {origin}
        self.nodes: list = []
        self.reads: list = []
        self.writes: list = []
        self.invalid = False


class Captures:
    """The captures in progress, by the agents of their streams, and the events last recorded inside one."""

    __slots__ = ("of", "recorded_in")

    def __init__(self):
        self.of: dict[int, Capture] = {}  # agent -> the capture its stream is in
        self.recorded_in: dict[int, Capture] = {}  # event -> the capture it was last recorded in

    def begin(self, agent: int, device: int) -> None:
        """``begin_capture`` succeeded on the stream of ``agent``."""
        self.of[agent] = Capture(agent, device)

    def call(self, agent: int, name: str, reads, writes, stack: int, ctx: int) -> bool:
        """A call on the stream of ``agent``: a node of its capture (True), or work that runs now (False)."""
        cap = self.of.get(agent)
        if cap is None:
            return False
        if reads or writes:
            cap.reads.extend(reads)
            cap.writes.extend(writes)
            cap.nodes.append((E.OP, agent, name, tuple(reads), tuple(writes), stack, ctx, 0))
        return True

    def record(self, event: int, agent: int, stack: int) -> bool:
        """``event`` recorded on the stream of ``agent``: a node of its capture (True), else a record now."""
        cap = self.of.get(agent)
        if cap is None:
            self.recorded_in.pop(event, None)
            return False
        self.recorded_in[event] = cap
        cap.nodes.append((E.EVENT_RECORD, event, agent, stack))
        return True

    def wait(self, event: int, agent: int, stack: int) -> bool:
        """The stream of ``agent`` waits on ``event``: an event recorded in a capture in progress makes it join
        that capture; then the wait is a node of it (True), else a wait now (False)."""
        cap = self.of.get(agent)
        if cap is None:
            cap = self.recorded_in.get(event)
            if cap is None or self.of.get(cap.origin) is not cap:
                return False
            cap.members.add(agent)
            self.of[agent] = cap
        cap.nodes.append((E.EVENT_WAIT, event, agent, stack))
        return True

    def end(self, agent: int, ok: bool) -> Capture | None:
        """``end_capture`` on the stream of ``agent`` returned (``ok``) or raised. On the origin the capture ends
        and every stream leaves it; it is returned if it gave a graph. On a stream that joined it the call fails
        (CUDA's "unmatched") and invalidates it; on any other stream it changes nothing."""
        cap = self.of.get(agent)
        if cap is None:
            return None
        if cap.origin != agent:
            cap.invalid = True
            return None
        for a in cap.members:
            if self.of.get(a) is cap:
                del self.of[a]
        for e in [e for e, c in self.recorded_in.items() if c is cap]:
            del self.recorded_in[e]
        return cap if ok and not cap.invalid else None
