"""Opening files the user names (traces, reports): the errors a user can cause become one line."""

from __future__ import annotations


def open_input(path: str, kind: str, error: type[Exception], mode: str = "r", **kwargs):
    """``open(path, mode)``; a missing file, a directory or an unreadable file raises ``error`` with a message
    naming the ``kind`` of file expected ("trace", "report")."""
    try:
        return open(path, mode, **kwargs)
    except FileNotFoundError:
        raise error(f"{path}: no such {kind} file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a {kind} file") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
