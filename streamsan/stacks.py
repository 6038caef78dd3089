"""Cheap Python stack capture for tracers.

At access time a stack is a tuple of (code id, line) pairs taken from the live frames, interned to a small
integer; the file / line / function triples are written once per distinct stack as a ``DEF_STACK`` event.
Frames of streamsan itself are skipped. Code objects are kept alive by the table so their ids stay unique.
Frames are never retained (that would keep tensors alive and change the program's memory behaviour).
"""

from __future__ import annotations

import os
import sys

from . import events as E
from .findings import is_library_frame

_OWN_DIRS = tuple(
    os.path.normcase(os.path.dirname(os.path.abspath(p))) + os.sep
    for p in (__file__, os.path.join(os.path.dirname(__file__), "..", "hooks", "x"))
)


def _is_own(filename: str) -> bool:
    return os.path.normcase(filename).startswith(_OWN_DIRS) or "streamsan" + os.sep + "hooks" + os.sep in filename


class StackTable:
    """Interns stacks; ``capture(events)`` returns a stack id, appending a DEF_STACK to ``events`` if new."""

    def __init__(self, depth: int = 10, user_depth: int = 3, max_depth: int = 40):
        self.depth = depth
        self.user_depth = user_depth
        self.max_depth = max_depth
        self.ids: dict[tuple, int] = {}
        self.codes: dict[int, object] = {}
        self._own: dict[int, bool] = {}
        self._lib: dict[int, bool] = {}

    def _classify(self, code) -> None:
        cid = id(code)
        self.codes[cid] = code
        self._own[cid] = _is_own(code.co_filename)
        self._lib[cid] = is_library_frame(code.co_filename)

    def capture(self, events: list, skip: int = 1) -> int:
        """Capture the caller's stack (innermost first), skipping ``skip`` frames and streamsan's own.

        Keeps ``depth`` frames, or more (up to ``max_depth``) until ``user_depth`` frames of user code are in.
        """
        f = sys._getframe(skip + 1)
        own = self._own
        lib = self._lib
        key = []
        n = users = 0
        while f is not None:
            code = f.f_code
            cid = id(code)
            o = own.get(cid)
            if o is None:
                self._classify(code)
                o = own[cid]
            if not o:
                key.append(cid)
                key.append(f.f_lineno)
                n += 1
                if not lib[cid]:
                    users += 1
                if (n >= self.depth and users >= self.user_depth) or n >= self.max_depth:
                    break
            f = f.f_back
        k = tuple(key)
        sid = self.ids.get(k)
        if sid is None:
            sid = self.ids[k] = len(self.ids) + 1
            codes = self.codes
            frames = []
            for i in range(0, len(k), 2):
                code = codes[k[i]]
                frames.append((code.co_filename, k[i + 1], getattr(code, "co_qualname", code.co_name)))
            events.append((E.DEF_STACK, sid, tuple(frames)))
        return sid
