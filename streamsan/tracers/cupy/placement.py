"""Where the CuPy tracer's events go: a traced call's op among the events fired inside it, host accesses to
pinned memory, the pinned blocks they are found in, host writes inferred before a copy, notes given once.

These are the CuPy tracer's own counterparts of helpers the torch tracer has too (``_place``, ``host_op``,
``pinned_range``, ``_staged_write``, ``_note_once``), kept together so that both tracers can share one version.
:class:`Placement` is a part of :class:`.tracer.CupyTracer`; it uses the tracer's ``buffer``, ``stacks``,
``staged``, ``pinned_blocks``, ``ctx``, ``running``, ``problems``, ``_numpy``, ``_tl``, ``_sink``, ``_cur_stack``
and ``_ops_on``.
"""

from __future__ import annotations

import bisect

from ... import events as E
from ..staging import WRITE_SEEN
from .ranges import array_address, host_range

# Events fired inside a traced call that belong before the call's OP (everything else goes after it).
_BEFORE_OP = frozenset({E.STREAM, E.DEF_STACK, E.DEF_CONTEXT, E.ALLOC, E.FREE, E.LABEL, E.NOTE})


class PinnedBlocks:
    """The pinned host blocks a tracer knows, by start address (sorted, found by bisection)."""

    def __init__(self):
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}

    def register(self, ptr: int, size: int) -> None:
        if ptr not in self._sizes:
            bisect.insort(self._starts, ptr)
        self._sizes[ptr] = size

    def find(self, ptr: int):
        """(start, size) of the known block holding ``ptr``, or None."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            s = self._starts[i]
            if ptr < s + self._sizes[s]:
                return s, self._sizes[s]
        return None


class Placement:
    """The CuPy tracer's placement of events (see the module's docstring)."""

    def _place(self, evs, agent, name, res, stack, pre) -> None:
        """Put a call's op among the events its thread fired inside it (``evs``, the call's own list):
        allocations, frees and declarations first, then ``pre`` (e.g. an inferred host write), the op, the rest."""
        op = None
        fresh = None
        if res is not None:
            reads, writes, flags, fresh = res
            if reads or writes or flags:
                op = (E.OP, agent, name, tuple(reads), tuple(writes), stack, self.ctx, flags)
                self.saw_cuda = True
                if writes and self.staged.kept:
                    self.staged.forget(writes)
        inner = evs[:]
        del evs[:]
        after = []
        for ev in inner:
            if ev[0] in _BEFORE_OP:
                if fresh and ev[0] == E.ALLOC and not ev[7] and ev[2] in fresh:
                    ev = ev[:7] + (fresh[ev[2]],) + ev[8:]  # (the description; the pool stays)
                evs.append(ev)
            else:
                after.append(ev)
        evs.extend(pre)
        if op is not None:
            evs.append(op)
        evs.extend(after)

    def host_op(self, name, reads, writes) -> None:
        """A host access to pinned memory through a :mod:`..pinned_numpy` view (ignored inside traced CuPy
        calls)."""
        if not self.running or getattr(self._tl, "depth", 0) or not (reads or writes) or not self._ops_on():
            return
        evs = self.buffer.events
        stack = self.stacks.capture(evs, 3)
        if writes and self.staged.kept:
            self.staged.forget(writes)
        evs.append((E.OP, E.HOST, name, tuple(reads), tuple(writes), stack, self.ctx, 0))

    def pinned_range(self, arr):
        """The PINNED range of a NumPy array over pinned memory this tracer knows (:mod:`..pinned_numpy`)."""
        if not arr.size or self.pinned_blocks.find(arr.__array_interface__["data"][0]) is None:
            return None
        return host_range(self, arr, known=True)

    def _staged_write(self, arr, r, pre) -> None:
        """An asynchronous copy reads ``r`` out of a pinned NumPy array: the host's writes to it that no traced
        call showed since the previous such copy from there (:mod:`streamsan.tracers.staging`), as a host write."""
        root = arr
        while isinstance(getattr(root, "base", None), self._numpy.ndarray):
            root = root.base
        written = self.staged.check(r, array_address(root), root, arr.itemsize)
        if written is not None:
            pre.append((E.OP, E.HOST, WRITE_SEEN, (), (written,), self._cur_stack(), self.ctx, 0))

    def _note_once(self, msg: str) -> None:
        """A warning note in the report, the first time ``msg`` is given."""
        if msg not in self.problems:
            self.problems.append(msg)
            self._sink().append((E.NOTE, "warning", msg))
