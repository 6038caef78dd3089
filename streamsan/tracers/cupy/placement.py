"""Where a traced CuPy call's op goes among the events its thread fired inside the call.

:func:`place` builds the call's op from what its analysis found and lays the call's events out with
:func:`streamsan.tracers.placement.split_inside`: allocations (described from the call's outputs), every free,
declarations, labels and notes first, then the host writes inferred before the call, the op, the rest.
"""

from __future__ import annotations

from ... import events as E
from ..placement import DECLARATIONS, split_inside

# The kinds besides allocations and frees that go before a CuPy call's op
EARLY = DECLARATIONS | {E.LABEL, E.NOTE}


def place(tracer, evs, agent: int, name: str, res, stack: int, pre) -> None:
    """Put a call's op among the events its thread fired inside it (``evs``, the call's own list, reordered in
    place). ``res``: the analysis's (reads, writes, flags, descriptions of the blocks it made by pointer), or None;
    no op when it has no accesses and no flags. ``pre``: events to place just before the op."""
    op = None
    fresh = None
    if res is not None:
        reads, writes, flags, fresh = res
        if reads or writes or flags:
            op = (E.OP, agent, name, tuple(reads), tuple(writes), stack, tracer.ctx, flags)
            tracer.saw_cuda = True
            if writes and tracer.staged.kept:
                tracer.staged.forget(writes)

    def described(ev):
        if not ev[7] and ev[2] in fresh:
            return ev[:7] + (fresh[ev[2]],) + ev[8:]  # (the description; the pool stays)
        return ev

    before, rest = split_inside(evs, early=EARLY, every_free=True, fill=described if fresh else None)
    evs[:] = before
    evs.extend(pre)
    if op is not None:
        evs.append(op)
    evs.extend(rest)
