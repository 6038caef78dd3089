"""Trace files: a versioned, compressed, append-only record of events that `streamsan replay` analyzes.

Format ``streamsan.trace/1``::

    file   := MAGIC frame*
    MAGIC  := b"SSTRACE1"
    frame  := length:u32le  crc32:u32le  type:u8  payload[length]      (crc32 over type + payload)
    type   := b"H" header  | b"E" events | b"M" events | b"Z" end

* ``H`` (first frame): zlib-compressed UTF-8 JSON object: ``{"format": "streamsan.trace/1", "created": ...,
  "pid": ..., "command": [...], "environment": {...}}``.
* ``E``: zlib-compressed Python ``marshal`` (version 4) of a list of events (tuples, see
  :mod:`streamsan.events`). marshal keeps replay fast; its format for ints, strings, tuples and lists is stable
  across Python versions. Every frame is checksummed before it is decoded.
* ``M``: the same list, marshalled but not compressed: what each process under ``streamsan wrap`` writes (its
  trace is read once, by the wrapping process), so that the traced program does not pay for compression.
* ``Z`` (last frame, absent if the writer died): zlib-compressed JSON ``{"events": N, "complete": true, ...}``,
  plus what the writer knew only at the end (``"environment"``: library versions once they were imported).

The writer appends a frame per batch and hands it to the OS at once, so a crash loses only the batch being
filled. A reader stops at the first truncated frame and reports the trace as incomplete. No frame is read or
inflated past :data:`MAX_FRAME` bytes, nor an event frame's outer list allocated past its bytes. The checksum
finds damage, not malice: a crafted frame that checksums can still make ``marshal`` allocate far more than its
size with a nested container (trace files are not meant for untrusted input).
"""

from __future__ import annotations

import json
import marshal
import os
import struct
import sys
import time
import zlib

from . import events as E
from .inputs import open_input

MAGIC = b"SSTRACE1"
FORMAT = "streamsan.trace/1"
_HDR = struct.Struct("<IIc")
MAX_FRAME = 1 << 28


class TraceError(Exception):
    """A trace file that cannot be read; the message is one line for the user."""


def _inflate(payload: bytes) -> bytes:
    """Decompress a frame's payload, refusing to inflate it past MAX_FRAME bytes (a zlib bomb)."""
    d = zlib.decompressobj()
    data = d.decompress(payload, MAX_FRAME)
    if not d.eof:
        if len(data) >= MAX_FRAME:
            raise zlib.error(f"inflates to more than {MAX_FRAME} bytes")
        raise zlib.error("incomplete or truncated stream")
    return data


class TraceWriter:
    """Appends frames to a trace file. ``write(batch)`` takes a list of event tuples.

    A batch that cannot be written (a full disk, an unmarshallable event) never reaches the traced program:
    the writer says so once on stderr, writes nothing more, and leaves the trace without its end mark.
    """

    def __init__(self, path: str, header: dict | None = None, compress: bool = True):
        self.path = path
        self.compress = compress
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.events = 0
        self.closed = False
        self.error: str | None = None
        h = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid()}
        h.update(header or {})
        os.write(self.fd, MAGIC)
        self._frame(b"H", zlib.compress(json.dumps(h, default=str).encode(), 6))

    def _frame(self, kind: bytes, payload: bytes) -> None:
        crc = zlib.crc32(payload, zlib.crc32(kind))
        data = _HDR.pack(len(payload), crc, kind) + payload
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def write(self, batch) -> None:
        if batch and not self.closed and self.error is None:
            try:
                data = marshal.dumps(list(batch), 4)
                if self.compress:
                    self._frame(b"E", zlib.compress(data, 1))
                else:
                    self._frame(b"M", data)
            except (OSError, ValueError) as e:
                self.error = getattr(e, "strerror", None) or str(e)
                print(f"streamsan: warning: cannot write the trace {self.path} ({self.error}): tracing stopped, "
                      "the report will be incomplete", file=sys.stderr)
                return
            self.events += len(batch)

    def close(self, extra: dict | None = None) -> None:
        if self.closed:
            return
        if self.error is not None:
            os.close(self.fd)
            self.closed = True
            return
        footer = {"events": self.events, "complete": True}
        footer.update(extra or {})
        self._frame(b"Z", zlib.compress(json.dumps(footer, default=str).encode()))
        os.close(self.fd)
        self.closed = True


class TraceReader:
    """Reads a trace file: :attr:`header`, then :meth:`batches` yields lists of validated-shape events.

    After iteration, :attr:`complete` says whether the end frame was seen and :attr:`problem` names the
    first damaged frame, if any (the events before it are still delivered).
    """

    def __init__(self, path: str):
        self.path = path
        self.f = open_input(path, "trace", TraceError, "rb")
        magic = self.f.read(len(MAGIC))
        if magic != MAGIC:
            self.f.close()
            if magic.startswith(b"SSTRACE"):
                raise TraceError(f"{path}: trace format {magic[7:].decode(errors='replace')!r} is not supported "
                                 f"(this streamsan reads {FORMAT})")
            raise TraceError(f"{path}: not a streamsan trace (bad magic bytes)")
        self.complete = False
        self.footer: dict = {}
        self.problem: str | None = None
        self.events = 0
        kind, payload = self._next() or (None, None)
        if kind != b"H":
            self.f.close()
            raise TraceError(f"{path}: trace header is missing or damaged")
        try:
            self.header = json.loads(_inflate(payload))
        except (zlib.error, ValueError, RecursionError):
            self.f.close()
            raise TraceError(f"{path}: trace header is damaged") from None
        fmt = self.header.get("format") if isinstance(self.header, dict) else None
        if fmt != FORMAT:
            self.f.close()
            raise TraceError(f"{path}: trace format {fmt!r} is not supported (this streamsan reads {FORMAT})")

    def _next(self):
        hdr = self.f.read(_HDR.size)
        if not hdr:
            return None
        if len(hdr) < _HDR.size:
            self.problem = "truncated frame header"
            return None
        length, crc, kind = _HDR.unpack(hdr)
        if length > MAX_FRAME:
            self.problem = f"frame of {length} bytes is larger than the format allows"
            return None
        payload = self.f.read(length)
        if len(payload) < length:
            self.problem = "truncated frame"
            return None
        if zlib.crc32(payload, zlib.crc32(kind)) != crc:
            self.problem = "checksum mismatch"
            return None
        return kind, payload

    def batches(self):
        try:
            while True:
                fr = self._next()
                if fr is None:
                    return
                kind, payload = fr
                if kind in (b"E", b"M"):
                    try:
                        data = _inflate(payload) if kind == b"E" else payload
                    except zlib.error as e:
                        self.problem = ("event frame " + str(e) if str(e).startswith("inflates")
                                        else "undecodable event frame")
                        return
                    # marshal allocates a list's items before reading them: check the outer list's claimed
                    # length against the bytes there are (a bomb of a few bytes could allocate 16 GiB).
                    if data[:1] not in (b"[", b"\xdb"):
                        self.problem = "event frame is not a list" if data else "undecodable event frame"
                        return
                    if int.from_bytes(data[1:5], "little") > len(data):
                        self.problem = "undecodable event frame"
                        return
                    try:
                        batch = marshal.loads(data)
                    except (ValueError, EOFError, TypeError, MemoryError):
                        self.problem = "undecodable event frame"
                        return
                    if not isinstance(batch, list):
                        self.problem = "event frame is not a list"
                        return
                    self.events += len(batch)
                    yield batch
                elif kind == b"Z":
                    self.complete = True
                    try:
                        footer = json.loads(_inflate(payload))
                    except (zlib.error, ValueError, RecursionError):
                        footer = None
                    self.footer = footer if isinstance(footer, dict) else {}
                    return
                else:
                    self.problem = f"unknown frame type {kind!r}"
                    return
        finally:
            self.f.close()


def validate_batch(batch, first_index: int = 0) -> list:
    """Validate every event of a batch (slow; used to explain a batch the analyzer could not apply)."""
    out = []
    for i, ev in enumerate(batch):
        try:
            out.append(E.validate(ev))
        except E.BadEvent as e:
            raise TraceError(f"event {first_index + i}: {e}") from None
    return out
