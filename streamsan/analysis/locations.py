"""Where an access happened, for dedup and reports: the innermost frame of user code in its stack.

Frames of library plumbing (torch, cupy, triton, pytest, the standard library...) are skipped, and a path is
spelled machine-independently (relative to site-packages, or its last 3 parts), so a location is stable across
runs and machines. Stacks are lists of ``[file, line, function]`` frames, innermost first.
"""

from __future__ import annotations

import re

# Frames in these places are library plumbing, not the code a user would fix.
_LIBRARY_FRAME = re.compile(
    r"([\\/](site|dist)-packages[\\/](torch|cupy|cupyx|cupy_backends|triton|fastrlock|typing_extensions|_pytest|pluggy)[\\/])"
    r"|([\\/]lib[\\/]python3\.\d+[\\/](?!site-packages|dist-packages)[^\\/]+(\.py|[\\/]))"
    r"|([\\/](site|dist)-packages[\\/]typing_extensions\.py$)"
    r"|(^<frozen )|(^<string>$)"
)


def is_library_frame(filename: str) -> bool:
    """Whether a frame's file is library plumbing rather than code a user would fix."""
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
