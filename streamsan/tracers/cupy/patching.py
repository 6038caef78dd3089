"""Replacing attributes of CuPy's classes and modules while a tracer runs, and putting them back.

A :class:`Patches` is what one patch module replaced: each replacement (and each other step to take back, such as
leaving a memory hook) is recorded as it is made, and :meth:`Patches.undo` takes them all back, the last first.
Used as a context manager around a patch module's work, it turns a failure (a CuPy version whose names differ)
into a note of the tracer's and keeps what was replaced before the failure until ``undo``: the program runs on,
traced less.
"""

from __future__ import annotations


class Patches:
    """The replacements one patch module made (``surface`` names it in the notes of its failures)."""

    def __init__(self, tracer, surface: str):
        self.tracer = tracer
        self.surface = surface
        self._undo: list = []

    def replace(self, obj, attr: str, value) -> None:
        """Set ``obj.attr`` to ``value``; :meth:`undo` restores the old value (of a class: its own, not an
        inherited one), or removes the attribute where it had none."""
        had = attr in vars(obj) if isinstance(obj, type) else hasattr(obj, attr)
        orig = vars(obj).get(attr) if isinstance(obj, type) else getattr(obj, attr, None)
        setattr(obj, attr, value)
        self._undo.append(lambda: setattr(obj, attr, orig) if had else delattr(obj, attr))

    def wrap(self, cls: type, attr: str, make) -> None:
        """Replace a class's own ``attr`` by ``make(the attribute)``."""
        self.replace(cls, attr, make(vars(cls)[attr]))

    def on_undo(self, step) -> None:
        """Call ``step()`` when undoing, in its turn among the replacements."""
        self._undo.append(step)

    def undo(self) -> None:
        """Take back every replacement and step, the last first; one that fails is skipped."""
        while self._undo:
            step = self._undo.pop()
            try:
                step()
            except Exception:
                pass

    def __enter__(self) -> "Patches":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and isinstance(exc, Exception):  # a CuPy version we do not know: trace less
            self.tracer._trouble(f"{self.surface}: {type(exc).__name__}: {exc}")
            return True
        return False
