"""CUDA graphs, for every tracer: work captured into a graph does not run when it is captured but at each launch,
on the launching stream, as a unit. A tracer keeps the accesses of the calls it saw during a capture and emits
each launch as one op with them; a graph whose nodes ran on several streams is also one ``GRAPH`` event after its
capture, its nodes checked against each other (docs/semantics.md, "Accesses the tracers infer")."""

from __future__ import annotations

import weakref

from .. import events as E

# The context of a graph's nodes that have none of their own (a race between them is one inside the graph)
NODE_CONTEXT = "captured in a CUDA graph: a race between its nodes happens at every launch"


def graph_event(nodes) -> tuple | None:
    """The ``GRAPH`` event of a capture's nodes (OP, EVENT_RECORD and EVENT_WAIT events in capture order) if they
    ran on two or more streams (on one, stream order alone orders them: nothing to check), else None."""
    agents = {n[1] if n[0] == E.OP else n[2] for n in nodes}
    return E.graph(nodes) if len(agents) > 1 else None


def merge_ranges(ranges) -> tuple:
    """Ranges as one op's reads or writes: duplicates dropped, overlapping contiguous ranges of a space merged
    (ranges of different allocations never overlap), strided ranges kept as they are."""
    out: list = []
    for sp, lo, n in sorted({r for r in ranges if len(r) == 3}):
        if out and out[-1][0] == sp and lo < out[-1][1] + out[-1][2]:
            _, plo, pn = out[-1]
            out[-1] = (sp, plo, max(plo + pn, lo + n) - plo)
        else:
            out.append((sp, lo, n))
    out.extend(dict.fromkeys(r for r in ranges if len(r) > 3))
    return tuple(out)


class GraphAccesses:
    """Each captured graph's (device, reads, writes), for its launches: held weakly by the graph where its type
    allows, else by its identity while the graph object lives in here too (until tracing stops)."""

    def __init__(self):
        self._weak = weakref.WeakKeyDictionary()
        self._kept: dict = {}  # id(graph) -> (graph, accesses)

    def put(self, graph, device: int, reads, writes) -> None:
        acc = (device, merge_ranges(reads), merge_ranges(writes))
        try:
            self._weak[graph] = acc
        except TypeError:
            self._kept[id(graph)] = (graph, acc)

    def get(self, graph):
        try:
            acc = self._weak.get(graph)
        except TypeError:
            acc = None
        if acc is None:
            kept = self._kept.get(id(graph))
            acc = kept[1] if kept is not None and kept[0] is graph else None
        return acc
