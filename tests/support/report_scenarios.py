"""Hand-made event sequences, one per finding kind, shaped after the transformers offloaded-cache bug
(DynamicCache(offloading=True) in transformers 5.17). Shared by the report, renderer and CLI tests.

Agents: 1 = the default stream (handle 0, role "default"), 2 = prefetch_stream, 3 = an unnamed side stream.
"""

from __future__ import annotations

from streamsan import events as E

DEFAULT, PREFETCH, SIDE = 1, 2, 3
PREFETCH_HANDLE = 0x55D1F00
SIDE_HANDLE = 0x77AA00
TORCH = "/venv/lib/python3.11/site-packages/torch/_tensor.py"
CACHE = "/home/u/proj/cache_utils.py"
MAIN = "/home/u/proj/run.py"

# stack ids: 1 offload (D2H), 2 prefetch (H2D), 3 update (torch.cat), 4 host read, 5 alloc of pinned,
# 6 alloc on prefetch_stream, 7 write on the side stream
STACKS = {
    1: [[TORCH, 10, "to"], [CACHE, 120, "offload"], [MAIN, 5, "<module>"]],
    2: [[TORCH, 10, "to"], [CACHE, 140, "prefetch"], [MAIN, 6, "<module>"]],
    3: [[CACHE, 160, "update"], [MAIN, 7, "<module>"]],
    4: [[MAIN, 9, "<module>"]],
    5: [[CACHE, 118, "offload"], [MAIN, 5, "<module>"]],
    6: [[CACHE, 138, "prefetch"], [MAIN, 6, "<module>"]],
    7: [[MAIN, 11, "<module>"]],
}
WHAT = "bfloat16[1, 8, 2, 128]"


def prologue() -> list:
    evs = [E.stream(DEFAULT, 0, 0, 0, "default"), E.stream(PREFETCH, 0, PREFETCH_HANDLE, 0, "prefetch_stream"),
           E.stream(SIDE, 0, SIDE_HANDLE, 0, "")]
    evs += [E.def_stack(i, f) for i, f in STACKS.items()]
    evs += [E.def_context(1, "transformers Cache.offload(layer_idx=3)"),
            E.def_context(2, "transformers Cache.prefetch(layer_idx=3)")]
    return evs


def pinned_d2h_then_h2d(iterations: int = 1) -> list:
    """device-device on pinned memory: offload's D2H on the default stream, then prefetch's H2D from the same
    pinned buffer on prefetch_stream, which never waited for the default stream."""
    evs = prologue()
    for i in range(iterations):
        pinned = 0x1000 + i * 0x10000
        evs += [
            E.alloc(E.PINNED, pinned, 4096, E.HOST, stack=5, what=WHAT),
            E.label(E.PINNED, pinned, 4096, "cache.layers[3].keys"),
            E.op(DEFAULT, "aten::copy_", reads=[(0, 0x9000, 4096)], writes=[(E.PINNED, pinned, 4096)], stack=1,
                 ctx=1),
            E.op(PREFETCH, "aten::copy_", reads=[(E.PINNED, pinned, 4096)], writes=[(0, 0xA000, 4096)], stack=2,
                 ctx=2),
        ]
    return evs


def host_read_after_d2h(synchronized: bool = False) -> list:
    """host-device: the host reads a pinned buffer that a D2H copy on the default stream is filling."""
    evs = prologue() + [
        E.alloc(E.PINNED, 0x1000, 4096, E.HOST, stack=5, what=WHAT),
        E.op(DEFAULT, "aten::copy_", reads=[(0, 0x9000, 4096)], writes=[(E.PINNED, 0x1000, 4096)], stack=1),
    ]
    if synchronized:
        evs.append(E.stream_sync(DEFAULT))
    evs.append(E.host_access("aten::sum", reads=[(E.PINNED, 0x1000, 4096)], stack=4))
    return evs


def missing_record_stream() -> list:
    """missing-record-stream: a tensor allocated on prefetch_stream is read by torch.cat on the default stream
    (which waited for prefetch_stream) and freed without record_stream; the next allocation on
    prefetch_stream gets its block."""
    return prologue() + [
        E.alloc(0, 0xA000, 4096, PREFETCH, stack=6, ctx=2, what=WHAT),
        E.label(0, 0xA000, 4096, "cache.layers[3].keys"),
        E.op(PREFETCH, "aten::copy_", reads=[(E.PINNED, 0x1000, 4096)], writes=[(0, 0xA000, 4096)], stack=2),
        E.event_record(1, PREFETCH), E.event_wait(1, DEFAULT),  # default_stream.wait_stream(prefetch_stream)
        E.op(DEFAULT, "aten::cat", reads=[(0, 0xA000, 4096)], writes=[(0, 0xC000, 8192)], stack=3),
        E.free(0, 0xA000),
        E.alloc(0, 0xA000, 4096, PREFETCH, stack=6, ctx=2, what=WHAT),
        E.op(PREFETCH, "aten::copy_", reads=[(E.PINNED, 0x1000, 4096)], writes=[(0, 0xA000, 4096)], stack=2),
    ]


def alloc_reuse() -> list:
    """alloc-reuse: a block of the default stream read by prefetch_stream, freed, and allocated again on the
    side stream from another library's pool (no release to the driver is implied; the default stream never
    allocates again), which writes it."""
    return prologue() + [
        E.alloc(0, 0xA000, 4096, DEFAULT, stack=3, what=WHAT),
        E.op(PREFETCH, "aten::copy_", reads=[(0, 0xA000, 4096)], writes=[(E.PINNED, 0x1000, 4096)], stack=2),
        E.free(0, 0xA000),
        E.alloc(0, 0xA000, 4096, SIDE, stack=7, what="float32[1024]", pool=E.FOREIGN_POOL),
        E.op(SIDE, "aten::fill_", writes=[(0, 0xA000, 4096)], stack=7),
    ]


def alloc_reuse_by_owner() -> list:
    """alloc-reuse: the default stream writes its block, frees it, allocates it again and the side stream
    writes the new tensor without waiting for the default stream."""
    return prologue() + [
        E.alloc(0, 0xB000, 4096, DEFAULT, stack=3, what=WHAT),
        E.op(DEFAULT, "aten::fill_", writes=[(0, 0xB000, 4096)], stack=3),
        E.free(0, 0xB000),
        E.alloc(0, 0xB000, 4096, DEFAULT, stack=7, what="float32[1024]"),
        E.op(SIDE, "aten::fill_", writes=[(0, 0xB000, 4096)], stack=7),
    ]


def analyze(events):
    from streamsan.analysis.analyzer import Analyzer
    a = Analyzer()
    a.feed(events)
    a.finish()
    return a


def recorded_too_early() -> list:
    """device-device despite syncs: prefetch_stream waits for an event the default stream recorded before its
    write (recorded too early), the default stream waits for prefetch_stream (the wrong direction) and the host
    synchronizes with the side stream and with prefetch_stream; none orders the write before the read."""
    return prologue() + [
        E.alloc(0, 0xA000, 4096, DEFAULT, stack=3, what=WHAT),
        E.event_record(1, DEFAULT, stack=4),
        E.op(DEFAULT, "aten::fill_", writes=[(0, 0xA000, 4096)], stack=3),
        E.event_record(2, PREFETCH), E.event_wait(2, DEFAULT),
        E.stream_sync(SIDE),
        E.stream_sync(PREFETCH, stack=7),
        E.event_wait(1, PREFETCH, stack=6),
        E.op(PREFETCH, "aten::copy_", reads=[(0, 0xA000, 4096)], writes=[(0, 0xC000, 4096)], stack=2),
    ]
