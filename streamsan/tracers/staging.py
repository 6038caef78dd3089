"""Host writes to pinned staging buffers that no traced call shows, found by the bytes they change.

Programs refill a pinned host buffer and copy it to the GPU asynchronously, step after step: vLLM's input
buffers, a CuPy staging array, a ring of pinned slots. The refill often goes through memory the tracer cannot
watch: a C extension, ``ctypes.memmove``, a plain NumPy array over the memory. If it comes before the stream has
finished the previous copy out of the buffer, that copy reads the new bytes.

:class:`PinnedStaging` keeps the bytes each small asynchronous host-to-device copy read, by the address it
started at. At the next such copy from the same address it compares them with the memory: bytes that changed,
with no traced access to them in between, were written by the host at some moment after the earlier copy was
issued. They are returned as a host write to place just before the new copy, the latest moment the write can
have happened. The host only ever learns more about the streams as it runs, so a write unordered with the earlier
copy at that moment was unordered at every moment before it: the analyzer reports it only when it is a race
whenever it happened. A write ordered there (the host synchronized in between) may still have come before the
synchronization; that case is not reported.

A traced write to kept bytes, another copy that reads them, or a new allocation of their block forgets them; so
does the death of the buffer's owner (the tensor or array that holds the block), since the block may then be
handed to new memory. Only copies of at most :data:`LIMIT` bytes are kept (staging buffers of inputs, positions,
tables), so large offloaded tensors cost nothing.
"""

from __future__ import annotations

import ctypes
import weakref

from .. import events as E

WRITE_SEEN = E.UNTRACED_REFILL  # the op a found write is reported as
LIMIT = 256 << 10  # bytes kept per copy
MAX_BLOCKS = 64  # places kept at once; the oldest are forgotten first


class PinnedStaging:
    """The bytes the latest small asynchronous copy out of each place of pinned memory read.

    ``block_of(owner)``: the base of the block an owner holds now (the owner is what keeps the block alive)."""

    def __init__(self, block_of):
        self.block_of = block_of
        self.kept: dict[int, tuple] = {}  # start -> (size, bytes, block base, weak reference to the owner)

    def check(self, rng: tuple, base: int, owner, itemsize: int = 1) -> tuple | None:
        """A copy reads ``rng`` (a PINNED range of elements of ``itemsize`` bytes) out of the block at ``base``,
        held by ``owner``: returns the range the host wrote since the previous copy from the same place (whole
        elements), or None, and keeps the bytes read now.
        Bytes kept for other places that this copy also reads are forgotten: a write found there later could
        have come before this copy."""
        if len(rng) > 3 or rng[2] > LIMIT:
            return None
        _, start, size = rng
        kept = self.kept
        old = kept.pop(start, None)
        written = None
        if old is not None:
            n, data, obase, ref = old
            holder = ref()
            if holder is not None and obase == base and self.block_of(holder) == base:
                now = ctypes.string_at(start, n)
                if now != data:
                    first, end = changed_span(data, now)
                    first -= first % itemsize
                    end = min(n, end + (-end) % itemsize)
                    written = (E.PINNED, start + first, end - first)
        if kept:
            self.forget((rng,))
        try:
            ref = weakref.ref(owner)
        except TypeError:  # an owner without weak references: nothing tells when the block may be reused
            return written
        kept[start] = (size, ctypes.string_at(start, size), base, ref)
        if len(kept) > MAX_BLOCKS:
            kept.pop(next(iter(kept)), None)
        return written

    def forget(self, ranges) -> None:
        """Traced accesses wrote ``ranges``: forget the kept bytes they overlap."""
        for r in ranges:
            if r[0] != E.PINNED:
                continue
            lo = r[1]
            hi = lo + r[2]
            for start, entry in list(self.kept.items()):
                if start < hi and lo < start + entry[0]:
                    self.kept.pop(start, None)  # (another thread's copy may have taken it meanwhile)


def changed_span(old: bytes, new: bytes) -> tuple[int, int]:
    """(first, end): the smallest slice outside which two equally long, different byte strings agree."""
    n = len(old)
    lo, hi = 0, n  # old[:lo] == new[:lo]; the first difference is below hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if old[lo:mid] == new[lo:mid]:
            lo = mid
        else:
            hi = mid
    first = lo
    lo, hi = first + 1, n  # old[hi:] == new[hi:]; the last difference is at or after lo - 1
    while hi > lo:
        mid = (lo + hi) // 2
        if old[mid:hi] == new[mid:hi]:
            hi = mid
        else:
            lo = mid + 1
    return first, hi


def refill_op(written, stack: int, ctx: int) -> tuple:
    """The host OP that rewrote ``written`` (a range :meth:`PinnedStaging.check` found) outside traced calls."""
    return (E.OP, E.HOST, WRITE_SEEN, (), (written,), stack, ctx, 0)


def host_access(staged: PinnedStaging, name: str, reads, writes, stack: int, ctx: int) -> tuple:
    """The host OP of an access the tracer sees to pinned memory (a view's, an op's on pinned tensors); the bytes
    ``staged`` kept that it writes are forgotten."""
    if writes and staged.kept:
        staged.forget(writes)
    return (E.OP, E.HOST, name, tuple(reads), tuple(writes), stack, ctx, 0)
