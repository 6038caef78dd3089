"""Names for the streams a program creates: the expression its creating line assigns the new stream to.

``self.copy_stream = torch.cuda.Stream()`` names its stream ``self.copy_stream`` in reports, so that a finding
says "on stream self.copy_stream" and its fix reads ``self.copy_stream.wait_stream(...)`` instead of a raw
handle. Only an assignment on the creating line gives a name (a name, an attribute chain, a subscript; or, for
``a, b = Stream(), Stream()``, the target in the place of the element being made; or the assignment whose
bracketed value continues onto the creating line); anything else (a stream passed
straight to a call, returned, unpacked from one call's result, or created by PyTorch's or CuPy's own code) leaves
the stream to its handle. A name given with :func:`streamsan.name_stream`
or by a library hook comes later and wins.
"""

from __future__ import annotations

import ast
import itertools
import linecache
import re
import sys

from ..analysis.locations import is_library_frame
from ..stacks import is_own_file

_TARGET = re.compile(r"^\s*([A-Za-z_][\w.]*(?:\[[^\]=\n]*\])*)\s*(?::[^=\n]+)?=(?!=)")


def caller_name(depth: int = 2) -> str | None:
    """:func:`creation_name` of the frame ``depth`` levels above this function's (2: the caller of a patched
    constructor that calls it), or None where the stack is not that deep (an object made from native code)."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    return creation_name(frame)


def creation_name(frame) -> str | None:
    """The expression that the first frame outside streamsan (``frame`` or a caller) assigns on its current
    line, or None (see the module's docstring)."""
    while frame is not None and is_own_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    filename = frame.f_code.co_filename
    if is_library_frame(filename):
        return None
    line = linecache.getline(filename, frame.f_lineno)
    name = assigned_to(line)
    if name is None and "," in line:
        name = unpacked_to(line, _column(frame))
    if name is None:
        name = continued_from(linecache.getlines(filename), frame.f_lineno)
    return name


def continued_from(lines: list, lineno: int, back: int = 4) -> str | None:
    """The target of an assignment whose value continues onto line ``lineno`` (1-based) from one of the ``back``
    lines before it, inside brackets it opened (``self.stream = (`` / ``Stream(...) if cuda else None`` / ``)``),
    or None (also where the source is not there or shorter: a program read from standard input, an edited file)."""
    if lineno > len(lines) + 1:
        return None
    for first in range(lineno - 1, max(lineno - 1 - back, 0), -1):
        target = assigned_to(lines[first - 1])
        if target is None:
            continue
        depth = 0
        for text in lines[first - 1:lineno - 1]:  # (open at the end of each: the statement goes on)
            depth += sum(text.count(c) for c in "([{") - sum(text.count(c) for c in ")]}")
            if depth <= 0:
                return None
        return target
    return None


def assigned_to(line: str) -> str | None:
    """``x.y[0]`` of ``x.y[0] = ...`` or ``x.y[0]: T = ...``; None for any other line."""
    m = _TARGET.match(line)
    return m.group(1) if m else None


def unpacked_to(line: str, col: int | None) -> str | None:
    """``b`` of ``a, b = x(), y()`` when the element being evaluated starts at column ``col`` (``y()``'s); None for
    any other line or column."""
    if col is None:
        return None
    indent = len(line) - len(line.lstrip())
    src = line.strip()
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign) or len(tree.body[0].targets) != 1:
        return None
    targets, values = tree.body[0].targets[0], tree.body[0].value
    if not isinstance(targets, (ast.Tuple, ast.List)) or not isinstance(values, (ast.Tuple, ast.List)) or \
            len(targets.elts) != len(values.elts):
        return None
    for t, v in zip(targets.elts, values.elts):
        if v.col_offset <= col - indent < v.end_col_offset:
            if isinstance(t, (ast.Name, ast.Attribute, ast.Subscript)):
                return ast.get_source_segment(src, t)
            return None
    return None


def _column(frame) -> int | None:
    """The column where the expression ``frame`` is evaluating now begins (Python 3.11+), or None."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is None:
        return None
    pos = next(itertools.islice(positions(), frame.f_lasti // 2, None), None)  # (one per 2-byte code unit)
    return pos[2] if pos is not None and pos[0] == frame.f_lineno else None
