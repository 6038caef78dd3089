"""Names for the streams a program creates: the expression its creating line assigns the new stream to.

``self.copy_stream = torch.cuda.Stream()`` names its stream ``self.copy_stream`` in reports, so that a finding
says "on stream self.copy_stream" and its fix reads ``self.copy_stream.wait_stream(...)`` instead of a raw
handle. Only a plain assignment on the creating line gives a name (a name, an attribute chain, a subscript);
anything else (a stream passed straight to a call, returned, unpacked into several names, or created by
PyTorch's or CuPy's own code) leaves the stream to its handle. A name given with :func:`streamsan.name_stream`
or by a library hook comes later and wins.
"""

from __future__ import annotations

import linecache
import re

from ..findings import is_library_frame
from ..stacks import is_own_file

_TARGET = re.compile(r"^\s*([A-Za-z_][\w.]*(?:\[[^\]=\n]*\])*)\s*(?::[^=\n]+)?=(?!=)")


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
    return assigned_to(linecache.getline(filename, frame.f_lineno))


def assigned_to(line: str) -> str | None:
    """``x.y[0]`` of ``x.y[0] = ...`` or ``x.y[0]: T = ...``; None for any other line."""
    m = _TARGET.match(line)
    return m.group(1) if m else None
