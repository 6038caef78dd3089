"""The events a captured CUDA graph records and waits for itself: those of ``torch.cuda.Event(external=True)``.

An event recorded or waited for on a capturing stream is, by default, only an edge between the graph's nodes. An
external one (``cudaEventRecordExternal`` / ``cudaEventWaitExternal``) is a node of its own: each launch of the
graph records the event when the record node runs (after the nodes it depends on inside the graph), and makes the
nodes that depend on a wait node wait for the event's latest record. So after ``graph.replay()``,
``end_event.synchronize()`` orders the host after the captured work before ``end_event.record()``, and a captured
``start_event.wait()`` orders the captured work after it behind the program's record of ``start_event``.

A replay is emitted in the replaying stream's order as a sequence (:func:`replay_plan`): op chunks of the captured
ops, with each external record placed after the longest run of leading ops that all precede it in the graph, and
each external wait before the shortest run of trailing ops that all follow it. That places no edge the graph does
not have (a record never orders an op that does not precede it, a wait never one that does not follow it); where
the graph's branches leave no exact place, the record goes earlier or the wait later, which can only add findings.
"""

from __future__ import annotations

from ... import events as E
from ..graphs import merge_ranges

OP_CHUNK, RECORD, WAIT = "ops", "record", "wait"


def graph_order(nodes) -> list[int]:
    """For each node of a capture (OP, EVENT_RECORD and EVENT_WAIT events in capture order), the bitmask of the nodes
    that precede it inside the graph: its stream's earlier nodes, and through a wait, the nodes up to the latest
    record of that event in the capture (with their own predecessors)."""
    pred: list[int] = []
    last: dict[int, int] = {}  # agent -> index of its latest node
    recorded: dict[int, int] = {}  # event -> index of its latest record in the capture
    for i, node in enumerate(nodes):
        agent = node[1] if node[0] == E.OP else node[2]
        m = 0
        j = last.get(agent)
        if j is not None:
            m |= pred[j] | (1 << j)
        if node[0] == E.EVENT_WAIT:
            r = recorded.get(node[1])
            if r is not None:
                m |= pred[r] | (1 << r)
        elif node[0] == E.EVENT_RECORD:
            recorded[node[1]] = i
        pred.append(m)
        last[agent] = i
    return pred


def replay_plan(nodes, external) -> tuple | None:
    """A replay as a sequence of (OP_CHUNK, reads, writes), (RECORD, event) and (WAIT, event) items, or None where the
    capture recorded and waited for no event of ``external`` (a set of event handles): the replay is then one op."""
    if not any(n[0] != E.OP and n[1] in external for n in nodes):
        return None
    pred = graph_order(nodes)
    ops = [i for i, n in enumerate(nodes) if n[0] == E.OP]
    slots: dict[int, list] = {}  # k -> the external records and waits placed after the k-th op
    for i, n in enumerate(nodes):
        if n[0] == E.OP or n[1] not in external:
            continue
        if n[0] == E.EVENT_RECORD:
            k = 0
            while k < len(ops) and (pred[i] >> ops[k]) & 1:
                k += 1
        else:
            k = len(ops)
            while k > 0 and (pred[ops[k - 1]] >> i) & 1:
                k -= 1
        slots.setdefault(k, []).append(i)
    plan: list = []
    chunk: list = []

    def flush():
        if chunk:
            plan.append((OP_CHUNK, merge_ranges(r for j in chunk for r in nodes[j][3]),
                         merge_ranges(r for j in chunk for r in nodes[j][4])))
            chunk.clear()

    for k in range(len(ops) + 1):
        placed = slots.get(k)
        if placed:
            flush()
            waits = [i for i in placed if nodes[i][0] == E.EVENT_WAIT]
            records = [i for i in placed if nodes[i][0] == E.EVENT_RECORD]
            # a wait goes before the records of its slot only if they all follow it (else it would order them)
            waits_first = all((pred[r] >> w) & 1 for r in records for w in waits)
            for i in (waits + records if waits_first else records + waits):
                plan.append((WAIT if nodes[i][0] == E.EVENT_WAIT else RECORD, nodes[i][1]))
        if k < len(ops):
            chunk.append(ops[k])
    flush()
    return tuple(plan)
