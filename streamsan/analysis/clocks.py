"""Vector clocks of the host and the streams, and the synchronization events that move them.

A clock is a plain list indexed by agent id (the shadow checks index it once per comparison, so it stays a bare
list). :class:`Clocks` holds every agent's clock and applies the happens-before edges of ``docs/semantics.md``
("Happens-before edges"), FastTrack-style: a stream's own component ticks only when its clock is published (event
record, a host sync on it, an implicit legacy-default-stream edge), so consecutive ops on a stream share an epoch.
The host publishes its clock on every enqueue and ticks lazily, before its next own access; every stream remembers
the host clock generation it last joined, so an enqueue costs no join unless the host learned something new.
"""

from __future__ import annotations

from .. import events as E

HOST = E.HOST


def join(dst: list, src: list) -> None:
    """dst becomes the component-wise maximum of dst and src (src no longer than dst)."""
    if len(src) == len(dst):
        dst[:] = map(max, dst, src)
    else:
        for i, v in enumerate(src):
            if v > dst[i]:
                dst[i] = v


def knows(clock: list, access) -> bool:
    """Whether an agent at vector clock ``clock`` has synchronized past ``access``: the access's epoch (its
    agent's component when it was made) is in the clock."""
    return access.clock <= clock[access.agent]


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


class Clocks:
    """Every agent's vector clock (``vc[agent]``), the declared agents and the clock snapshots of recorded events.

    ``host_gen`` counts what the host learned; ``joined_gen[a]``: the generation stream a last joined;
    ``host_published``: an enqueue saw the host's current epoch (its next own access ticks it first);
    ``implicit[a]``: the streams whose latest work an enqueue on a waits for (legacy default stream edges).
    """

    def __init__(self):
        self.vc: list[list[int]] = [[1]]
        self.agents: dict[int, AgentInfo] = {HOST: AgentInfo(HOST, -1, 0, 0, "host")}
        self.events: dict[int, list[int]] = {}
        self.host_gen = 1
        self.joined_gen: list[int] = [0]
        self.host_published = False
        self.implicit: list[list[int]] = [[]]

    # ------------------------------------------------------------------ agents
    def declare(self, agent: int, device: int, handle: int, flags: int, name: str) -> None:
        """A stream agent's (re)declaration: a new one gets a clock that has seen its own first epoch."""
        info = self.agents.get(agent)
        if info is not None:
            info.device, info.handle, info.flags = device, handle, flags
            if name:
                info.name = name
            self._legacy_edges()
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
        self._legacy_edges()

    def _legacy_edges(self) -> None:
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

    # ------------------------------------------------------------------ work and host accesses
    def enqueue(self, a: int) -> list:
        """Work is enqueued on stream a: it joins the host's clock (and implicit legacy-stream edges). Returns a's
        clock. Raises IndexError, before changing anything, for an agent id beyond every declared one."""
        vc = self.vc
        if self.joined_gen[a] != self.host_gen:
            join(vc[a], vc[HOST])
            self.joined_gen[a] = self.host_gen
            self.host_published = True
        imp = self.implicit[a]
        if imp:
            t = vc[a]
            for b in imp:
                join(t, vc[b])
                vc[b][b] += 1
        return vc[a]

    def host_access(self) -> list:
        """The host accesses memory: a new epoch if an enqueue saw the current one. Returns the host's clock."""
        if self.host_published:
            self.vc[HOST][HOST] += 1
            self.host_gen += 1
            self.host_published = False
        return self.vc[HOST]

    def host_learns(self, clock: list) -> None:
        """The host waited for a point whose clock is ``clock``."""
        join(self.vc[HOST], clock)
        self.host_gen += 1

    def host_waits_for(self, a: int) -> None:
        """The host waited for stream a's latest work (a stream sync, or the end of a blocking op)."""
        t = self.vc[a]
        self.host_learns(t)
        t[a] += 1

    # ------------------------------------------------------------------ synchronization
    def event_record(self, event: int, a: int) -> None:
        t = self.enqueue(a)
        self.events[event] = t[:]
        t[a] += 1

    def event_wait(self, event: int, a: int) -> None:
        t = self.enqueue(a)
        snap = self.events.get(event)
        if snap is not None:
            join(t, snap)

    def event_delete(self, event: int) -> None:
        self.events.pop(event, None)

    def event_sync(self, event: int) -> bool:
        """The host waits for an event; False (nothing learned) for one never recorded."""
        snap = self.events.get(event)
        if snap is None:
            return False
        self.host_learns(snap)
        return True

    def device_sync(self, device: int) -> None:
        vc = self.vc
        h = vc[HOST]
        for a, info in self.agents.items():
            if a != HOST and info.device == device:
                join(h, vc[a])
                vc[a][a] += 1
        self.host_learns(h)
