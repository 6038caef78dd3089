"""Synthetic event traces shaped like an eager decode loop, for analyzer benchmarks.

Per step and layer: a handful of ops on the default stream reading weights and activations and writing fresh
outputs (allocated, then freed a few ops later: allocation churn that reuses addresses), views at offsets,
an H2D prefetch on a side stream with event record / wait, and a D2H offload into pinned memory; a device
synchronize every few steps. Deterministic for a given seed.
"""

from __future__ import annotations

import random

from streamsan import events as E

DEFAULT, SIDE, SIDE2 = 1, 2, 3


def decode_trace(n_events: int, seed: int = 0, churn: int = 1):
    """Yield about ``n_events`` events. ``churn`` > 1 allocates fresh addresses more often (heavier churn)."""
    rnd = random.Random(seed)
    yield E.stream(DEFAULT, 0, 0, E.LEGACY_DEFAULT, "default")
    yield E.stream(SIDE, 0, 0x5000, 0, "prefetch_stream")
    yield E.stream(SIDE2, 0, 0x6000, 0, "side2")
    frames = [(f"model/layer{i}.py", 10 + i, "forward") for i in range(8)]
    for sid in range(1, 9):
        yield E.def_stack(sid, [frames[sid - 1], ("app/main.py", 5, "main")])
    weights = [(0x10_0000_0000 + i * 0x10_0000, 0x10000) for i in range(64)]
    for w, size in weights:
        yield E.alloc(0, w, size, DEFAULT, 1)
    emitted = 3 + 8 + len(weights)
    free_slots = [0x20_0000_0000 + i * 0x8000 for i in range(256)]  # a caching allocator's free list
    rnd.shuffle(free_slots)
    fresh = 0x30_0000_0000
    pinned_base = 0x7f00_0000_0000
    live: list[tuple[int, int]] = []
    event_id = 1
    step = 0
    while emitted < n_events:
        step += 1
        for layer in range(8):
            stack = layer + 1
            # prefetch on the side stream, ordered by an event
            yield E.event_record(event_id, DEFAULT)
            yield E.event_wait(event_id, SIDE)
            src = pinned_base + layer * 0x4000
            dst = free_slots.pop() if churn == 1 else fresh
            fresh += 0x8000
            yield E.alloc(0, dst, 0x4000, SIDE, stack)
            yield E.op(SIDE, "aten::_to_copy", reads=[(E.PINNED, src, 0x4000)], writes=[(0, dst, 0x4000)],
                       stack=stack)
            yield E.event_record(event_id + 1, SIDE)
            yield E.event_wait(event_id + 1, DEFAULT)
            yield E.event_delete(event_id)
            yield E.event_delete(event_id + 1)
            event_id += 2
            emitted += 9
            live.append((dst, 0x4000))
            for k in range(6):
                w, wsize = weights[(layer * 6 + k) % len(weights)]
                a, asize = live[-1]
                out = free_slots.pop() if churn == 1 else fresh
                fresh += 0x8000
                yield E.alloc(0, out, asize, DEFAULT, stack)
                reads = [(0, w, wsize), (0, a, asize)]
                if k == 3:
                    reads.append((0, a + 256, 512, (4, (8, 16), (32, 1))))
                yield E.op(DEFAULT, "aten::mm", reads=reads, writes=[(0, out, asize)], stack=stack)
                live.append((out, asize))
                emitted += 2
                if len(live) > 6:
                    old, _ = live.pop(0)
                    yield E.free(0, old)
                    if churn == 1:
                        free_slots.insert(0, old)
                    emitted += 1
            while len(live) > 6:  # the layer's prefetched block dies too: live memory stays flat
                old, _ = live.pop(0)
                yield E.free(0, old)
                if churn == 1:
                    free_slots.insert(0, old)
                emitted += 1
            # offload: D2H into pinned memory on the default stream
            a, asize = live[-1]
            yield E.op(DEFAULT, "aten::_to_copy", reads=[(0, a, asize)],
                       writes=[(E.PINNED, pinned_base + layer * 0x4000, min(asize, 0x4000))], stack=stack)
            emitted += 1
        if step % 4 == 0:
            yield E.device_sync(0)
            emitted += 1
