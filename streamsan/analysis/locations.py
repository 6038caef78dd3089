"""Findings: one hazard each, with its fingerprint, occurrence count and the facts needed to explain it.

A finding is built by the analyzer from two :class:`~streamsan.shadow.Access` records. Its fingerprint is
stable across runs and machines: the kind plus the innermost *user-code* location (file:line) of each access,
so one bug in a loop is one finding with a count, not one per iteration.
"""

from __future__ import annotations

import hashlib
import re

DEVICE_DEVICE = "device-device"
HOST_DEVICE = "host-device"
ALLOC_REUSE = "alloc-reuse"
MISSING_RECORD_STREAM = "missing-record-stream"
KINDS = (DEVICE_DEVICE, HOST_DEVICE, ALLOC_REUSE, MISSING_RECORD_STREAM)

# Frames in these places are library plumbing, not the code a user would fix.
_LIBRARY_FRAME = re.compile(
    r"([\\/](site|dist)-packages[\\/](torch|cupy|cupyx|cupy_backends|triton|fastrlock|typing_extensions|_pytest|pluggy)[\\/])"
    r"|([\\/]lib[\\/]python3\.\d+[\\/](?!site-packages|dist-packages)[^\\/]+(\.py|[\\/]))"
    r"|(^<frozen )|(^<string>$)"
)


def is_library_frame(filename: str) -> bool:
    return bool(_LIBRARY_FRAME.search(filename))


def short_path(filename: str) -> str:
    """A machine-independent spelling of a source path: relative to site-packages, or its last 3 parts."""
    for marker in ("site-packages/", "dist-packages/"):
        i = filename.rfind(marker)
        if i >= 0:
            return filename[i + len(marker):]
    parts = re.split(r"[\\/]", filename)
    return "/".join(parts[-3:])


def user_frame(frames):
    """The innermost frame of user code (a [file, line, function] triple), or the innermost frame, or None."""
    for f in frames:
        if not is_library_frame(f[0]):
            return f
    return frames[0] if frames else None


# The file of the frame a tracer puts first in the stack of a backward op that PyTorch's autograd engine runs in a
# thread without Python frames; its function is the backward node (``MulBackward0``), the frames after it are where
# ``backward()`` was called.
ENGINE_FRAME = "<autograd engine>"


def location(frames, fallback: str) -> str:
    """Where an access happened, for a report: the innermost user frame as ``path:line``; for a backward op of the
    autograd engine, its node and where ``backward()`` was called."""
    f = user_frame(frames)
    if f is None:
        return fallback
    if f[0] == ENGINE_FRAME:
        outer = user_frame(frames[1:])
        return f"{f[2]} (backward() at {short_path(outer[0])}:{outer[1]})" if outer else f"{f[2]} (backward)"
    return f"{short_path(f[0])}:{f[1]}"


def fingerprint(kind: str, loc_prev: str, loc_cur: str) -> str:
    return hashlib.sha1(f"{kind}|{loc_prev}|{loc_cur}".encode()).hexdigest()[:16]


class Finding:
    """One distinct hazard.

    ``previous`` / ``current``: the earlier and the later access (Access objects; for missing-record-stream the
    later one is the allocation on the owner stream that was free to reuse the block). ``prev_write`` /
    ``cur_write``: their access types on the conflicting memory. ``space``, ``lo``, ``hi``: where the conflict
    was found (for missing-record-stream, the freed block). ``block``: the allocation life of the later
    access's memory; ``prev_block``: the earlier life, for alloc-reuse and missing-record-stream.
    ``reused``: the block really was handed to the new allocation.
    """

    __slots__ = ("kind", "fingerprint", "count", "previous", "current", "prev_write", "cur_write", "space",
                 "lo", "hi", "block", "prev_block", "reused", "prev_loc", "cur_loc")

    def __init__(self, kind, fp, previous, current, prev_write, cur_write, space, lo, hi, block, prev_block,
                 prev_loc, cur_loc):
        self.kind = kind
        self.fingerprint = fp
        self.count = 1
        self.previous = previous
        self.current = current
        self.prev_write = prev_write
        self.cur_write = cur_write
        self.space = space
        self.lo = lo
        self.hi = hi
        self.block = block
        self.prev_block = prev_block
        self.reused = False
        self.prev_loc = prev_loc
        self.cur_loc = cur_loc

    def __repr__(self) -> str:
        return (f"Finding({self.kind}, {self.prev_loc} -> {self.cur_loc}, agents {self.previous.agent}->"
                f"{self.current.agent}, x{self.count})")
