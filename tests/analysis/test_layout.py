"""streamsan.analysis.layout.touch_common_bytes: whether two byte ranges (dense or strided views) share a byte.

Exact for small views and for views that are boxes in one nested stride system (any size); conservative (True)
only for large views that are neither.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


from streamsan.analysis.layout import MAX_RUNS, touch_common_bytes



def view(start, itemsize, sizes, strides, space=0):
    """A strided range as a tracer builds it: extent = (last element offset + 1) * itemsize."""
    if any(n == 0 for n in sizes):
        extent = 0
    else:
        extent = (sum((n - 1) * s for n, s in zip(sizes, strides)) + 1) * itemsize
    return (space, start, extent, (itemsize, tuple(sizes), tuple(strides)))


def dense(start, size, space=0):
    return (space, start, size)


def touched(r):
    """Brute force: the set of bytes a range touches."""
    if len(r) == 3 or r[3] is None:
        return set(range(r[1], r[1] + r[2]))
    itemsize, sizes, strides = r[3]
    out = set()
    for idx in itertools.product(*(range(n) for n in sizes)):
        off = r[1] + sum(i * s for i, s in zip(idx, strides)) * itemsize
        out.update(range(off, off + itemsize))
    return out


def extents_overlap(a, b):
    return a[1] < b[1] + b[2] and b[1] < a[1] + a[2]


def both(a, b):
    """touch_common_bytes in both argument orders (it must be symmetric)."""
    x, y = touch_common_bytes(a, b), touch_common_bytes(b, a)
    assert x == y
    return x


# ------------------------------------------------------------------ dense


def test_dense_ranges():
    assert both(dense(0, 100), dense(50, 100))
    assert both(dense(0, 100), dense(99, 1))
    assert not both(dense(0, 100), dense(100, 1))
    assert both(dense(10, 1), dense(0, 100))


# ------------------------------------------------------------------ x: float32[N, 128]


def cols(n_rows, c0, c1, base=0x10000):
    return view(base + c0 * 4, 4, (n_rows, c1 - c0), (128, 1))


@pytest.mark.parametrize("n_rows", [2, 8, 100, 1 << 16])
def test_column_halves_do_not_touch(n_rows):
    # x[:, :64] vs x[:, 64:]: overlapping extents, no common element (large ones use the box test, exactly)
    a, b = cols(n_rows, 0, 64), cols(n_rows, 64, 128)
    assert extents_overlap(a, b)
    assert not both(a, b)


@pytest.mark.parametrize("n_rows", [2, 8, 100, 1 << 16])
def test_overlapping_columns_touch(n_rows):
    assert both(cols(n_rows, 0, 65), cols(n_rows, 64, 128))
    assert both(cols(n_rows, 10, 20), cols(n_rows, 19, 21))
    assert not both(cols(n_rows, 10, 20), cols(n_rows, 20, 21))


def test_strided_view_vs_dense_range():
    base = 0x10000
    right = cols(8, 64, 128, base)
    assert not both(right, dense(base + 512, 256))  # row 1, columns 0..63
    assert both(right, dense(base + 512 + 252, 8))  # row 1, columns 63..64
    assert not both(right, dense(base + 512 + 252, 4))


def test_transpose_touches_the_original():
    base = 0x10000
    x = dense(base, 64)  # float32[4, 4]
    xt = view(base, 4, (4, 4), (1, 4))
    assert both(x, xt)
    # the transpose of the first column is the first row: x.t()[0, :] is x[:, 0]
    assert both(view(base, 4, (4,), (4,)), dense(base, 4))
    assert not both(view(base + 4, 4, (4,), (4,)), dense(base + 16, 4))  # x[:, 1] vs x[1, 0]
    assert both(view(base + 4, 4, (4,), (4,)), dense(base + 16, 8))  # x[:, 1] vs x[1, 0:2]


def test_size_one_dimensions_are_ignored():
    base = 0x10000
    a = view(base, 4, (1, 64), (999, 1))  # x[0:1, :64] with an arbitrary stride on the size-1 dim
    assert both(a, dense(base + 252, 4))
    assert not both(a, dense(base + 256, 4))


def test_empty_views_touch_nothing():
    base = 0x10000
    empty = (0, base, 16, (4, (0, 4), (4, 1)))  # even with a (bogus) non-zero extent
    assert not both(empty, dense(base, 64))


def test_sliding_windows_overlap_each_other():
    # x.unfold(0, 4, 1) of a float32[8]: sizes (5, 4), strides (1, 1)
    base = 0x10000
    w = view(base, 4, (5, 4), (1, 1))
    assert both(w, dense(base + 28, 4))
    assert not both(w, dense(base + 32, 4))


def test_non_nested_strides_small_views_are_exact():
    # bytes 4i + 6j (i, j < 20): even bytes only; the same view at an odd start touches only odd bytes
    a = view(0x10000, 1, (20, 20), (4, 6))
    b = view(0x10001, 1, (20, 20), (4, 6))
    assert extents_overlap(a, b)
    assert not both(a, b)
    assert both(a, view(0x10002, 1, (20, 20), (4, 6)))


def test_large_non_nested_views_are_conservative():
    # the same shapes, too many runs to enumerate and not a box: reported as touching (documented)
    n = 200
    assert n * n > MAX_RUNS
    a = view(0x10000, 1, (n, n), (4, 6))
    b = view(0x10001, 1, (n, n), (4, 6))
    assert both(a, b) is True


def test_expanded_view_vs_dense():
    base = 0x10000
    y = view(base, 4, (8, 128), (0, 1))  # float32[1, 128].expand(8, 128)
    assert both(y, dense(base, 512))


def test_expanded_column_vs_other_column():
    base = 0x10000
    col1 = view(base + 4, 4, (4,), (4,))
    assert not both(view(base, 4, (4, 3), (4, 0)), col1)  # x[:, 0:1].expand(4, 3)
    assert both(view(base + 4, 4, (4, 3), (4, 0)), col1)  # x[:, 1:2].expand(4, 3)


def test_stride_zero_on_a_size_one_dim_is_harmless():
    base = 0x10000
    assert both(view(base, 4, (1, 4), (0, 1)), dense(base + 12, 4))


# ------------------------------------------------------------------ against brute force


@st.composite
def layouts(draw, zero_strides=False):
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    nd = draw(st.integers(0, 3))
    sizes = tuple(draw(st.integers(0, 5)) for _ in range(nd))
    lo = 0 if zero_strides else 1
    strides = tuple(draw(st.integers(lo, 12)) if n > 1 else draw(st.integers(0, 12)) for n in sizes)
    start = draw(st.integers(0, 64))
    return view(start, itemsize, sizes, strides)


ranges = st.one_of(layouts(), st.builds(dense, st.integers(0, 64), st.integers(1, 80)))


@settings(max_examples=3000, deadline=None)
@given(ranges, ranges)
def test_matches_brute_force(a, b):
    if not extents_overlap(a, b):
        return
    assert touch_common_bytes(a, b) == bool(touched(a) & touched(b)), (a, b)


@settings(max_examples=3000, deadline=None)
@given(layouts(zero_strides=True), st.one_of(layouts(zero_strides=True), ranges))
def test_matches_brute_force_with_expanded_views(a, b):
    if not extents_overlap(a, b):
        return
    assert touch_common_bytes(a, b) == bool(touched(a) & touched(b)), (a, b)
