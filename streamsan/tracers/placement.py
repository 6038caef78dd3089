"""Where a traced call's op goes among the events its thread fired while the call ran.

A call's allocations (and the declarations later events name: streams, stacks, contexts) happened before its
work could run, so they go before its op; so do the frees of the blocks it allocated and freed inside, in their
order (a block may be handed out again within the call). The rest (the call's synchronizations, event records,
frees of older memory) comes after the op, or where the tracer places its kernel among them.
"""

from __future__ import annotations

from .. import events as E

DECLARATIONS = frozenset({E.STREAM, E.DEF_STACK, E.DEF_CONTEXT})


def split_inside(inner, early=DECLARATIONS, every_free: bool = False, fill=None) -> tuple[list, list]:
    """(the events that go before the op, the rest), each in the order they were fired in ``inner``.

    Before the op: allocations (each through ``fill``, where given, which may complete it from the call's
    outputs), events of a kind in ``early``, and frees: every one (``every_free``) or those of blocks allocated
    inside the call."""
    before, rest = [], []
    temporaries = set()  # (space, pointer) of the blocks allocated inside the call and not freed yet
    for ev in inner:
        kind = ev[0]
        if kind == E.ALLOC:
            if fill is not None:
                ev = fill(ev)
            before.append(ev)
            temporaries.add((ev[1], ev[2]))
        elif kind == E.FREE and (every_free or (ev[1], ev[2]) in temporaries):
            temporaries.discard((ev[1], ev[2]))
            before.append(ev)
        elif kind in early:
            before.append(ev)
        else:
            rest.append(ev)
    return before, rest
