"""Replacing attributes of PyTorch's classes and modules, and putting back exactly what was there.

Each patched surface records what it replaced in a :class:`Replaced`, whose ``undo`` is what its ``install``
returns.
"""

from __future__ import annotations


class Replaced:
    """The attributes one patched surface replaced: (owner, name, original), in the order replaced."""

    __slots__ = ("entries",)

    def __init__(self):
        self.entries: list = []

    def add(self, owner, attr: str, orig) -> None:
        """``owner.attr`` was ``orig`` (None: inherited, not the owner's own) before it was replaced."""
        self.entries.append((owner, attr, orig))

    def undo(self) -> None:
        """Put every original back, the last replaced first (an inherited one: by deleting the replacement)."""
        while self.entries:
            owner, attr, orig = self.entries.pop()
            if orig is None:  # the patch shadowed an inherited attribute
                delattr(owner, attr)
            else:
                set_type_attr(owner, attr, orig)


def set_type_attr(cls, attr: str, value) -> bool:
    """Set a class attribute, also on a C type that refuses it (``torch.Event`` and ``torch.Stream`` are
    immutable types): there the type's own dict is updated and CPython told that the type changed. Returns
    whether the attribute is set."""
    try:
        setattr(cls, attr, value)
        return True
    except TypeError:
        pass
    try:
        import ctypes
        import gc

        (own,) = [d for d in gc.get_referents(cls.__dict__) if isinstance(d, dict)]
        own[attr] = value
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(cls))
    except (AttributeError, ValueError, OSError):  # not CPython, or a dict it does not expose
        return False
    return cls.__dict__.get(attr) is value
