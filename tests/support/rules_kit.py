"""Hand-built analyzer inputs and exact-finding checks, for the tests of the analyzer's rules.

Conventions: streams A=1, B=2, C=3 (device 0, non-blocking) unless a test declares others; device memory at
``BASE`` on device 0 (``D(off, size)``); pinned host memory at ``PIN`` in space ``PINNED`` (``P(off, size)``).
"""

from __future__ import annotations

from streamsan.analysis.analyzer import Analyzer
from streamsan.events import PINNED, alloc, rng, stream

A, B, C = 1, 2, 3
BASE = 0x7F00_0000_0000
PIN = 0x5500_0000_0000
KB = 1024


def streams(*agents, device=0):
    return [stream(a, device, 0x1000 * a) for a in agents]


def base3():
    """Streams A, B, C on device 0 and a 4 KiB device block owned by A at BASE."""
    return streams(A, B, C) + [alloc(0, BASE, 4 * KB, A, what="float32[1024]")]


def run(events, **kw):
    a = Analyzer(keep_occurrences=True, **kw)
    a.feed(events)
    a.finish()
    return a


def none(events, **kw):
    a = run(events, **kw)
    assert a.sorted_findings() == [], a.sorted_findings()
    assert a.occurrences == [], a.occurrences
    return a


def one(events, kind, prev, cur, lo, hi, space=0, count=1, prev_write=None, cur_write=None, **kw):
    """Exactly one finding, with these facts. ``prev`` / ``cur``: (agent, op name)."""
    a = run(events, **kw)
    fs = a.sorted_findings()
    assert len(fs) == 1, fs
    f = fs[0]
    check(f, kind, prev, cur, lo, hi, space, count, prev_write, cur_write)
    return a, f


def check(f, kind, prev, cur, lo, hi, space=0, count=1, prev_write=None, cur_write=None):
    got = (f.kind, (f.previous.agent, f.previous.name), (f.current.agent, f.current.name), f.space, f.lo, f.hi,
           f.count)
    assert got == (kind, prev, cur, space, lo, hi, count), f
    if prev_write is not None:
        assert f.prev_write is prev_write
    if cur_write is not None:
        assert f.cur_write is cur_write


def D(off, size, layout=None):
    """A device range at BASE + off."""
    return rng(0, BASE + off, size, layout)


def P(off, size, layout=None):
    """A pinned host range at PIN + off."""
    return rng(PINNED, PIN + off, size, layout)
