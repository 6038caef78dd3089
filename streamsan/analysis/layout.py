"""Element-exact overlap of two strided views.

A range's extent over-approximates the bytes a strided view touches (``x[:, :64]`` and ``x[:, 64:]`` of one
storage have overlapping extents but no common element). :func:`touch_common_bytes` decides whether two
ranges really share a byte, exactly where it can and conservatively (``True``) where the views are too large
to enumerate and not regular enough to compare in closed form.
"""

from __future__ import annotations

MAX_RUNS = 1 << 15


def _dims(start: int, layout) -> tuple[int, list[tuple[int, int]]]:
    """Byte-level dimensions (size, byte stride) of a view, size-1 dims dropped, largest stride first,
    with the innermost run of contiguous bytes folded into a final stride-1 dimension."""
    itemsize, sizes, strides = layout
    dims = [(n, s * itemsize) for n, s in zip(sizes, strides) if n == 0 or (n != 1 and s != 0)]  # stride 0 repeats
    dims.append((itemsize, 1))
    dims.sort(key=lambda d: -d[1])
    folded: list[tuple[int, int]] = []
    for n, s in dims:
        if folded and folded[-1][1] == s * n:  # the previous dim is this one repeated contiguously
            pn, _ = folded.pop()
            n, s = pn * n, s
        folded.append((n, s))
    # fold again from the inside: (n1, s1), (n2, 1) with s1 == n2 is one run of n1 * n2 bytes
    out: list[tuple[int, int]] = []
    for n, s in reversed(folded):
        if out and out[-1][1] == 1 and s == out[-1][0]:
            m, _ = out.pop()
            out.append((n * m, 1))
        else:
            out.append((n, s))
    out.reverse()
    return start, out


def _runs(start: int, dims: list[tuple[int, int]], limit: int):
    """Sorted list of [lo, hi) byte runs, or None when there are more than ``limit``."""
    inner_n, inner_s = dims[-1]
    if inner_s == 1:
        run_len, outer = inner_n, dims[:-1]
    else:
        run_len, outer = 1, dims
    count = 1
    for n, _ in outer:
        count *= n
        if count > limit:
            return None
    offsets = [start]
    for n, s in outer:
        offsets = [o + i * s for o in offsets for i in range(n)]
    offsets.sort()
    return [(o, o + run_len) for o in offsets]


def _intersect(a, b) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        lo1, hi1 = a[i]
        lo2, hi2 = b[j]
        if lo1 < hi2 and lo2 < hi1:
            return True
        if hi1 <= hi2:
            i += 1
        else:
            j += 1
    return False


def _as_box(start: int, dims: list[tuple[int, int]], strides: list[int]):
    """Coordinates of a view as a box in a nested mixed-radix system with the given byte strides
    (largest first, each a multiple of the next), or None when the view is not such a box."""
    box = []
    rem = start
    sizes = dict((s, n) for n, s in dims)
    if len(sizes) != len(dims):
        return None
    for k, s in enumerate(strides):
        c, rem = divmod(rem, s)
        n = sizes.get(s, 1)
        limit = strides[k - 1] // s if k else None
        if limit is not None and c + n > limit:
            return None
        box.append((c, c + n))
    if rem:
        return None
    return box


def touch_common_bytes(r1, r2) -> bool:
    """Whether ranges r1 and r2 (same space, overlapping extents) share at least one byte."""
    lay1 = r1[3] if len(r1) > 3 else None
    lay2 = r2[3] if len(r2) > 3 else None
    if lay1 is None and lay2 is None:
        return r1[1] < r2[1] + r2[2] and r2[1] < r1[1] + r1[2]
    s1, d1 = _dims(r1[1], lay1) if lay1 is not None else (r1[1], [(r1[2], 1)])
    s2, d2 = _dims(r2[1], lay2) if lay2 is not None else (r2[1], [(r2[2], 1)])
    if any(n == 0 for n, _ in d1) or any(n == 0 for n, _ in d2):
        return False
    strides = sorted({s for _, s in d1} | {s for _, s in d2}, reverse=True)
    if all(strides[k] % strides[k + 1] == 0 for k in range(len(strides) - 1)) and strides[-1] == 1:
        b1 = _as_box(s1, d1, strides)
        b2 = _as_box(s2, d2, strides)
        if b1 is not None and b2 is not None:
            return all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(b1, b2))
    runs1 = _runs(s1, d1, MAX_RUNS)
    runs2 = _runs(s2, d2, MAX_RUNS) if runs1 is not None else None
    if runs1 is None or runs2 is None:
        return True
    return _intersect(runs1, runs2)
