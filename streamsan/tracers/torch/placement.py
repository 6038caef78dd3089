"""Placing an op among the events fired inside it: its allocations before it, its kernel after the barrier it waits
for, syncs after it; and the op's own event list, which keeps them apart from other threads' events meanwhile.

``tracer.op_agent`` and each entry of ``buffer.ops_of_threads`` is the op a thread is dispatching, laid out as
``OP_FIELDS`` names (the C core reads and makes them too).
"""

from __future__ import annotations

import threading

from ... import events as E
from ..placement import split_inside
from . import device
from .tensors import output_blocks

_get_ident = threading.get_ident

# the positions of the fields of an op being dispatched (``op_agent``): its device (-1 for a host op), the agent it
# runs on, its stack and context, the thread dispatching it, the events that thread fired inside it (OpEvents)
OP_FIELDS = {"device": 0, "agent": 1, "stack": 2, "ctx": 3, "thread": 4, "events": 5}


class OpEvents(list):
    """The events a thread's callbacks fire inside one of its ops (its allocations, a copy's event record, a
    blocking copy's synchronization), kept apart from the buffer until the op is placed among them: another
    thread's events, or a flush, in the meantime cannot get between them or reorder them."""

    __slots__ = ()


def run_inside(tracer, func, args, kwargs, dev: int, stack: int):
    """Run an op; on a device (``dev`` >= 0) its current stream is the agent of the events fired inside the op
    (allocations, a copy's events). Returns (output, agent, the event list, where the events fired inside start):
    the op's own list (:class:`OpEvents`: the events its thread fired inside it, whatever other threads did
    meanwhile), to place the op in and :func:`commit`. (The Python dispatch spells this out: it is the hot
    path.)"""
    me = _get_ident()
    if dev >= 0:
        a = tracer.agent(dev, device.raw_stream(dev))
        mine = tracer.op_agent = tracer.buffer.ops_of_threads[me] = (dev, a, stack, tracer.ctx, me, OpEvents())
    else:  # a host op (pinning): its own list all the same, or other threads' events would count as inside it
        a = E.HOST
        mine = tracer.buffer.ops_of_threads[me] = (-1, a, stack, tracer.ctx, me, OpEvents())
    try:
        out = func(*args, **kwargs)
    finally:
        tracer.buffer.ops_of_threads.pop(me, None)
        if tracer.op_agent is mine:
            tracer.op_agent = None
    return out, a, mine[5], 0


def commit(tracer, evs) -> None:
    """Hand an op's own event list (:class:`OpEvents`, once its events are placed) to the buffer, at once."""
    if evs.__class__ is OpEvents and evs:
        tracer.buffer.events.extend(evs)


def fill_alloc_sizes(tracer, evs, mark, out) -> None:
    """Size the allocations an op without accesses made (``empty``...) and give them the op's stack."""
    sizes = output_blocks(out)
    stack = 0
    for i in range(mark, len(evs)):
        ev = evs[i]
        if ev[0] == E.ALLOC and ev[3] == 0 and ev[2] in sizes:
            size, what = sizes[ev[2]]
            if not stack:
                stack = tracer.stacks.outside(evs)  # (called from C too)
            evs[i] = (E.ALLOC, ev[1], ev[2], size, ev[4], ev[5] or stack, ev[6], what) + ev[8:]


def place(tracer, evs, mark, op, out, pre=(), collective: bool = False) -> None:
    """Reorder the events fired inside an op (``evs[mark:]``): ``pre``, then its allocations (sized from its
    outputs) with the frees of the temporaries it allocated and freed inside
    (:func:`streamsan.tracers.placement.split_inside`), then the barrier its kernel waits for
    (:func:`_kernel_position`), then the op, then everything else (a blocking copy's synchronization, the pinned
    allocator's event record, frees of memory allocated before). A collective is moved to the stream it runs on."""
    if tracer.staged.kept:
        tracer.staged.forget(op[4])
    sizes = output_blocks(out)
    if not pre and all(ev[0] == E.ALLOC for ev in evs[mark:]):  # the common case: only allocations
        for i in range(mark, len(evs)):
            ev = evs[i]
            if ev[3] == 0 and ev[2] in sizes:
                size, what = sizes[ev[2]]
                evs[i] = (E.ALLOC, ev[1], ev[2], size, ev[4], ev[5] or op[5], ev[6] or op[6], what) + ev[8:]
        evs.append(op)
        return

    def sized(ev):
        if ev[3] == 0 and ev[2] in sizes:
            size, what = sizes[ev[2]]
            return (E.ALLOC, ev[1], ev[2], size, ev[4], ev[5] or op[5], ev[6] or op[6], what) + ev[8:]
        return ev

    before, rest = split_inside(evs[mark:], fill=sized)
    del evs[mark:]
    evs.extend(pre)
    evs.extend(before)
    barrier, agent = _kernel_position(rest, op[1], collective)
    kept_alive = ()
    if agent != op[1]:
        op = (op[0], agent) + op[2:]
        _name_collective_stream(tracer, evs, agent)
        kept_alive = _kept_alive_for(op)
    evs.extend(rest[:barrier])
    evs.append(op)
    evs.extend(kept_alive)
    evs.extend(rest[barrier:])


def _name_collective_stream(tracer, evs, agent: int) -> None:
    """Reports call the stream a collective ran on "collective stream" (it is the library's own)."""
    streams = tracer.streams
    if agent in streams.collective:
        return
    streams.collective.add(agent)
    for key, a in tracer.agent_of.items():
        if a == agent:
            evs.append((E.STREAM, agent, key[0], key[1], streams.flags_of.get(key, 0), "collective stream"))
            return


def _kernel_position(inner: list, agent: int, collective: bool) -> tuple[int, int]:
    """(how many of the events fired inside an op happened before its kernel, the agent the kernel runs on).

    Before the kernel: the barrier a cross-device copy enqueues first (an event recorded on the destination's
    stream, then waited for by the op's own stream); for a collective, the hand-off to its communication stream
    (an event recorded on the current stream, then waited for by that stream, where the kernel runs). Everything
    from the first event recorded on the op's own stream on (a copy's completion barrier, the pinned allocator's
    event, a collective's end event) and synchronizations of the host come after the kernel."""
    if collective and len(inner) >= 2:
        rec, wait = inner[0], inner[1]
        if rec[0] == E.EVENT_RECORD and rec[2] == agent and wait[0] == E.EVENT_WAIT and wait[1] == rec[1] \
                and wait[2] != agent:
            return 2, wait[2]
    end = 0
    for i, ev in enumerate(inner):
        kind = ev[0]
        if kind == E.EVENT_WAIT and ev[2] == agent:
            end = i + 1
        elif (kind == E.EVENT_RECORD and ev[2] == agent) or kind not in (E.EVENT_RECORD, E.EVENT_WAIT):
            break
    return end, agent


def _kept_alive_for(op) -> list:
    """A collective on its own stream keeps its tensors' memory from reuse until it has run (ProcessGroupNCCL
    records them on its stream, or, since PyTorch 2.6 or so, holds them in the ``Work`` until ``wait()`` or until
    it has completed): modelled as ``record_stream`` on that stream of every device block the op touches."""
    agent, stack = op[1], op[5]
    return [(E.RECORD_STREAM, r[0], r[1], agent, stack) for r in op[3] + op[4] if r[0] >= 0]  # device memory
