"""The notes a tracer leaves for the report, each once: what it could not analyze, or why it stopped.

A note is known by a key (the torch tracer keys its notes by topic, the CuPy tracer by their text); the first
note of a key is kept and delivered, later ones are dropped. :func:`warning` is the NOTE event of a text.
"""

from __future__ import annotations

from .. import events as E


class Notes:
    """The keys of the notes left so far, and their texts in order."""

    __slots__ = ("keys", "texts")

    def __init__(self):
        self.keys: set = set()
        self.texts: list[str] = []

    def __contains__(self, key) -> bool:
        return key in self.keys

    def first(self, key, text: str) -> bool:
        """Whether this is the first note of ``key`` (then ``text`` is kept)."""
        if key in self.keys:
            return False
        self.keys.add(key)
        self.texts.append(text)
        return True


def warning(text: str) -> tuple:
    """The NOTE event of a warning."""
    return (E.NOTE, "warning", text)
