"""Read one table of a TOML file without a TOML library (Python 3.10 without ``tomli``).

Enough for ``[tool.streamsan]``: ``key = value`` lines whose value is a string (basic or literal), a boolean or
an integer, with comments. Anything else in that table raises ValueError; the rest of the file is skipped.
"""

from __future__ import annotations

import re

_HEADER = re.compile(r"^\[\s*([A-Za-z0-9_.\- ]+?)\s*\]\s*(#.*)?$")
_PAIR = re.compile(r"^([A-Za-z0-9_-]+)\s*=\s*(.*)$")
_BASIC = re.compile(r'^"((?:[^"\\]|\\.)*)"\s*(#.*)?$')
_LITERAL = re.compile(r"^'([^']*)'\s*(#.*)?$")
_BARE = re.compile(r"^(true|false|[+-]?\d+)\s*(#.*)?$")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}


def _value(text: str, lineno: int):
    m = _BASIC.match(text)
    if m:
        return re.sub(r"\\(.)", lambda e: _ESCAPES.get(e.group(1), e.group(0)), m.group(1))
    m = _LITERAL.match(text)
    if m:
        return m.group(1)
    m = _BARE.match(text)
    if m:
        v = m.group(1)
        return v == "true" if v in ("true", "false") else int(v)
    raise ValueError(f"line {lineno}: unsupported value {text!r} (install tomli to read it)")


def table(text: str, name: tuple) -> dict | None:
    """The table ``name`` (e.g. ``("tool", "streamsan")``) as a dict, or None if the file has none."""
    want = ".".join(name)
    out = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            if out is not None:  # the next table (or array of tables) ends ours
                return out
            header = _HEADER.match(line)
            if header and re.sub(r"\s*\.\s*", ".", header.group(1)) == want:
                out = {}
            continue
        if out is None:
            continue
        m = _PAIR.match(line)
        if not m:
            raise ValueError(f"line {lineno}: expected key = value, got {line!r}")
        out[m.group(1)] = _value(m.group(2).strip(), lineno)
    return out
