"""What the rest of streamsan uses of a tracer: :class:`Tracer` (the session, the library hooks and the package's
``name_stream`` / ``label``) and :class:`PinnedMemoryOwner` (the NumPy views of :mod:`.pinned_numpy`). The torch
and the CuPy tracer implement both.

A session also reads ``stopped_on_bug`` where a tracer has it (the torch tracer's), and gives the torch tracer its
``on_note`` and ``patch_triton``; the package asks the CuPy tracer whether it ``owns`` a stream or an array.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Tracer(Protocol):
    """A tracer of one library, feeding the session's event buffer."""

    buffer: object  # the session's streamsan.sink.EventBuffer
    streams: object  # the session's streamsan.agents.StreamRegistry
    scope: str  # "full" or "hooks" (ops traced inside push_context regions only)
    ctx: int  # the context id of the hooked region the program is in (0: none)
    running: bool
    saw_cuda: bool

    def start(self) -> None:
        """Patch the library and begin tracing."""

    def stop(self) -> None:
        """Undo every patch and hand the last events to the buffer."""

    def name_stream(self, stream, name: str) -> None:
        """Give one of the library's streams a role name for reports."""

    def label(self, obj, text: str) -> None:
        """Name the memory of one of the library's tensors or arrays for reports."""

    def push_context(self, text: str) -> int:
        """Enter a hooked region: its accesses carry ``text``; returns what :meth:`pop_context` restores."""

    def pop_context(self, prev: int) -> None:
        """Leave the hooked region entered last."""


@runtime_checkable
class PinnedMemoryOwner(Protocol):
    """What a pinned NumPy view asks the tracers attached to it (:func:`.pinned_numpy.attach`)."""

    def pinned_range(self, arr):
        """The PINNED range of an array over pinned memory the tracer knows, or None."""

    def host_op(self, name: str, reads, writes) -> None:
        """A host access through a view, when it happens."""
