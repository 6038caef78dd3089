"""Views and memory layouts across streams: how precisely streamsan decides which accesses conflict.

Real code hands slices, chunks, columns, transposes, dtype reinterpretations and windows of one storage to different
streams all the time; a detector that flags disjoint views is useless on it, and one that misses overlapping views
misses real races. docs/semantics.md: a range is a byte interval of the physical allocation (storage pointer,
offset and extent of the view); views of one storage that share no byte never race, overlapping ones at different
offsets do, and a strided range touches only the bytes of its elements (``x[::2]`` and ``x[1::2]`` have overlapping
extents and no common byte).

Every program sets up its tensors, ``torch.cuda.synchronize()``, then makes the two accesses under test with no
edge between them (two side streams "s1" and "s2", or the host and "s1" through pinned memory), then
``torch.cuda.synchronize()`` while the tensors are alive: the only edge a racy program lacks is the one between those
two accesses. Disjoint versions expect ``[]``; overlapping ones the (kind, previous role, previous op, current role,
current op) of their one finding. ``x.add_(1)`` / ``x.mul_(2)`` with a Python number are ``aten::add_.Tensor`` /
``aten::mul_.Tensor`` (the number becomes a CPU scalar tensor, no memory streamsan follows); ``fill_`` / ``zero_``
on a view write only the view's elements.
"""

import torch
from tests.gpu.support.scenario_kit import scenario_tests, streams


N = 1 << 12  # small enough that every strided pair here is decided element-exactly
R, C = 64, 64  # a row-major matrix: row r is contiguous, column c has stride C


def _vector():
    x = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    return x


def _matrix():
    m = torch.zeros(R, C, device="cuda")
    torch.cuda.synchronize()
    return m


# ------------------------------------------------------------------ slices, chunk, split, narrow (1-D)
def slices_disjoint_halves():
    """``x[:n]`` and ``x[n:]`` share no byte: writes on two streams never race."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        x[: N // 2].fill_(1.0)
    with torch.cuda.stream(s2):
        x[N // 2:].fill_(2.0)
    torch.cuda.synchronize()


def slices_overlap_by_one_element():
    """``x[:n+1]`` and ``x[n:]`` share element n: the off-by-one of a hand-split buffer is a write-write race."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        x[: N // 2 + 1].fill_(1.0)
    with torch.cuda.stream(s2):
        x[N // 2:].add_(1)
    torch.cuda.synchronize()


def chunk_uneven_thirds_disjoint():
    """``torch.chunk`` into three uneven pieces (1366, 1366, 1364 elements): s1 writes the outer two, s2 the middle
    one, which borders both."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    first, middle, last = torch.chunk(x, 3)
    with torch.cuda.stream(s1):
        first.fill_(1.0)
        last.fill_(3.0)
    with torch.cuda.stream(s2):
        middle.mul_(2)
    torch.cuda.synchronize()


def split_sizes_disjoint():
    """``torch.split`` with sizes [1, N - 2, 1]: s1 writes the one-element ends, s2 reads everything between."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    head, body, tail = torch.split(x, [1, N - 2, 1])
    with torch.cuda.stream(s1):
        head.fill_(-1.0)
        tail.fill_(-1.0)
    with torch.cuda.stream(s2):
        total = body.sum()
    torch.cuda.synchronize()
    del total


def narrow_middle_vs_ends_disjoint():
    """``narrow``: s1 writes the middle half, s2 reads the first and the last quarter."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        x.narrow(0, N // 4, N // 2).fill_(1.0)
    with torch.cuda.stream(s2):
        lo = x.narrow(0, 0, N // 4).sum()
        hi = x.narrow(0, 3 * N // 4, N // 4).sum()
    torch.cuda.synchronize()
    del lo, hi


# ------------------------------------------------------------------ interleaved strided views
def strided_even_odd_disjoint():
    """``x[::2]`` and ``x[1::2]``: their extents overlap almost entirely, their elements not at all."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        x[::2].fill_(1.0)
    with torch.cuda.stream(s2):
        x[1::2].fill_(2.0)
    torch.cuda.synchronize()


def strided_every_second_vs_every_third():
    """``x[::2]`` written while ``x[::3]`` is read: they share elements 0, 6, 12, ... (a read after write race)."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        x[::2].fill_(1.0)
    with torch.cuda.stream(s2):
        total = x[::3].sum()
    torch.cuda.synchronize()
    del total


# ------------------------------------------------------------------ columns, transposes, rows
def column_blocks_disjoint():
    """Column blocks of a row-major matrix, split at a column that is no multiple of 16 bytes: ``m[:, :5]`` on s1,
    ``m[:, 5:]`` on s2. Every row of one lies between two rows of the other."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        m[:, :5].add_(1)
    with torch.cuda.stream(s2):
        m[:, 5:].mul_(2)
    torch.cuda.synchronize()


def transposed_column_vs_row_tail_disjoint():
    """Row 0 of ``m.t()`` is column 0 of ``m`` (stride C): s1 reads it while s2 writes row 5 from column 1 on, which
    lies inside the column's extent but holds none of its elements."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        total = m.t()[0].sum()
    with torch.cuda.stream(s2):
        m[5, 1:].fill_(2.0)
    torch.cuda.synchronize()
    del total


def transposed_column_vs_whole_row():
    """The same read while s2 writes all of row 5: element (5, 0) is in both (a write after read race)."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        total = m.t()[0].sum()
    with torch.cuda.stream(s2):
        m[5].fill_(2.0)
    torch.cuda.synchronize()
    del total


def select_adjacent_columns_disjoint():
    """``m.select(1, 0)`` and ``m.select(1, 1)``: two strided columns whose elements are neighbours in memory."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        m.select(1, 0).fill_(1.0)
    with torch.cuda.stream(s2):
        m.select(1, 1).fill_(2.0)
    torch.cuda.synchronize()


def unbind_rows_disjoint():
    """``m.unbind(0)``: s1 writes the even rows, s2 the odd rows, one op per row."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    rows = m.unbind(0)
    with torch.cuda.stream(s1):
        for row in rows[0::2]:
            row.fill_(1.0)
    with torch.cuda.stream(s2):
        for row in rows[1::2]:
            row.fill_(2.0)
    torch.cuda.synchronize()


def expanded_column_vs_other_column_disjoint():
    """``m[:, 1:2].expand(R, C)`` (stride 0 along the columns: a broadcast of column 1) is read on s1 while s2 writes
    column 2: the expanded view touches column 1's elements only."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        total = m[:, 1:2].expand(R, C).sum()
    with torch.cuda.stream(s2):
        m[:, 2].fill_(2.0)
    torch.cuda.synchronize()
    del total


def expanded_column_vs_same_column():
    """The same broadcast read while s2 scales column 1 itself (a write after read race)."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        total = m[:, 1:2].expand(R, C).sum()
    with torch.cuda.stream(s2):
        m[:, 1].mul_(2)
    torch.cuda.synchronize()
    del total


# ------------------------------------------------------------------ dtype reinterpretation
def int16_view_write_vs_bfloat16_read():
    """``x.view(torch.int16)`` of a bfloat16 tensor is the same bytes: clearing sign bits through it on s1 while
    s2 sums the bfloat16 tensor is a read after write race."""
    s1, s2 = streams("s1", "s2")
    x = torch.full((N,), -1.5, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        x.view(torch.int16).bitwise_and_(0x7FFF)
    with torch.cuda.stream(s2):
        total = x.sum()
    torch.cuda.synchronize()
    del total


def byte_view_lower_half_vs_upper_half_disjoint():
    """The first 2N bytes of ``x.view(torch.uint8)`` are exactly the float32 elements below N / 2: zeroing them on
    s1 does not race with s2's read of ``x[N // 2:]``."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        x.view(torch.uint8)[: 2 * N].zero_()
    with torch.cuda.stream(s2):
        total = x[N // 2:].sum()
    torch.cuda.synchronize()
    del total


def byte_view_one_byte_into_upper_half():
    """One byte more (``[: 2 * N + 1]``) is the low byte of element N / 2, which s2 reads: a race on one byte."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        x.view(torch.uint8)[: 2 * N + 1].zero_()
    with torch.cuda.stream(s2):
        total = x[N // 2:].sum()
    torch.cuda.synchronize()
    del total


# ------------------------------------------------------------------ windows: unfold and as_strided
def unfold_windows_disjoint():
    """``x.unfold(0, 3, 8)`` (elements 8k .. 8k+2) on s1 and ``x[4:].unfold(0, 3, 8)`` (8k+4 .. 8k+6) on s2: the
    windows of one fall in the gaps of the other."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        x.unfold(0, 3, 8).fill_(1.0)
    with torch.cuda.stream(s2):
        x[4:].unfold(0, 3, 8).fill_(2.0)
    torch.cuda.synchronize()


def unfold_windows_overlap():
    """s1 reads the windows 8k .. 8k+3 while s2 writes the windows 8k+3 .. 8k+4: they share every element 8k+3."""
    s1, s2 = streams("s1", "s2")
    x = _vector()
    with torch.cuda.stream(s1):
        total = x.unfold(0, 4, 8).sum()
    with torch.cuda.stream(s2):
        x[3:].unfold(0, 2, 8).fill_(2.0)
    torch.cuda.synchronize()
    del total


def as_strided_quadrants_disjoint():
    """``as_strided`` tiles of a matrix: the top-left quadrant on s1 and the top-right one (storage offset C / 2) on
    s2, whose extents interleave row by row."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        m.as_strided((R // 2, C // 2), (C, 1)).fill_(1.0)
    with torch.cuda.stream(s2):
        m.as_strided((R // 2, C // 2), (C, 1), C // 2).fill_(2.0)
    torch.cuda.synchronize()


def as_strided_patch_over_quadrant_corner():
    """A 2 x 2 ``as_strided`` patch centred on the middle of the matrix holds the top-left quadrant's bottom-right
    element: s2's read of it races with s1's write of the quadrant."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        m.as_strided((R // 2, C // 2), (C, 1)).fill_(1.0)
    with torch.cuda.stream(s2):
        total = m.as_strided((2, 2), (C, 1), (R // 2 - 1) * C + C // 2 - 1).sum()
    torch.cuda.synchronize()
    del total


# ------------------------------------------------------------------ reshape: a view or a copy
def reshape_copy_write_vs_original_read():
    """``m.t().reshape(-1)`` cannot be a view (the transpose is not contiguous): it is a copy made on s1, so s1's
    writes to it do not race with s2's read of ``m``."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        flat = m.t().reshape(-1)
        flat.mul_(2)
    with torch.cuda.stream(s2):
        total = m.sum()
    torch.cuda.synchronize()
    del flat, total


def reshape_view_write_vs_original_read():
    """``m.reshape(-1)`` of a contiguous matrix is a view: s1 writes ``m`` through it while s2 reads it."""
    s1, s2 = streams("s1", "s2")
    m = _matrix()
    with torch.cuda.stream(s1):
        flat = m.reshape(-1)
        flat.mul_(2)
    with torch.cuda.stream(s2):
        total = m.sum()
    torch.cuda.synchronize()
    del flat, total


# ------------------------------------------------------------------ pinned host memory: the host and a stream
def _pinned_staging():
    (s1,) = streams("s1")
    h = torch.arange(R * C, dtype=torch.float32).reshape(R, C).pin_memory()
    d = torch.empty(R // 2, C, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        d.copy_(h[R // 4: 3 * R // 4], non_blocking=True)  # the H2D copy reads the middle rows of h
    return h, d


def pinned_host_writes_outer_rows_during_h2d():
    """The host writes rows 0 and R - 1 of a pinned matrix through one strided view (``h[::R - 1]``, a CPU op whose
    extent spans all of h) while s1's non-blocking copy reads the middle rows: no common byte."""
    h, d = _pinned_staging()
    h[:: R - 1].fill_(-1.0)
    torch.cuda.synchronize()
    del h, d


def pinned_host_writes_copied_row_during_h2d():
    """The same kind of view with stride R / 2 holds rows 0 and R / 2, and row R / 2 is one the pending copy reads:
    a host-device race."""
    h, d = _pinned_staging()
    h[:: R // 2].fill_(-1.0)
    torch.cuda.synchronize()
    del h, d


# ------------------------------------------------------------------ 3-D
def planes_of_3d_disjoint():
    """``x[:, 0, :]`` and ``x[:, 1, :]`` of an (8, 4, 64) tensor: strided planes, one row of each per outer index."""
    s1, s2 = streams("s1", "s2")
    x = torch.zeros(8, 4, 64, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        x[:, 0, :].fill_(1.0)
    with torch.cuda.stream(s2):
        x[:, 1, :].fill_(2.0)
    torch.cuda.synchronize()


def planes_of_3d_crossing():
    """``x[:, 0, :]`` written while ``x[..., 0]`` is read: they share the eight elements ``x[i, 0, 0]``."""
    s1, s2 = streams("s1", "s2")
    x = torch.zeros(8, 4, 64, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        x[:, 0, :].fill_(1.0)
    with torch.cuda.stream(s2):
        total = x[..., 0].sum()
    torch.cuda.synchronize()
    del total


SCENARIOS = [
    slices_disjoint_halves, slices_overlap_by_one_element, chunk_uneven_thirds_disjoint, split_sizes_disjoint,
    narrow_middle_vs_ends_disjoint,
    strided_even_odd_disjoint, strided_every_second_vs_every_third,
    column_blocks_disjoint, transposed_column_vs_row_tail_disjoint, transposed_column_vs_whole_row,
    select_adjacent_columns_disjoint, unbind_rows_disjoint,
    expanded_column_vs_other_column_disjoint, expanded_column_vs_same_column,
    int16_view_write_vs_bfloat16_read, byte_view_lower_half_vs_upper_half_disjoint,
    byte_view_one_byte_into_upper_half,
    unfold_windows_disjoint, unfold_windows_overlap, as_strided_quadrants_disjoint,
    as_strided_patch_over_quadrant_corner,
    reshape_copy_write_vs_original_read, reshape_view_write_vs_original_read,
    pinned_host_writes_outer_rows_during_h2d, pinned_host_writes_copied_row_during_h2d,
    planes_of_3d_disjoint, planes_of_3d_crossing,
]

# (kind, previous role, previous op, current role, current op) per scenario, in the order streamsan reports them.
EXPECTED = {
    "slices_disjoint_halves": [],
    "slices_overlap_by_one_element": [
        ("device-device", "s1", "aten::fill_.Scalar", "s2", "aten::add_.Tensor"),
    ],
    "chunk_uneven_thirds_disjoint": [],
    "split_sizes_disjoint": [],
    "narrow_middle_vs_ends_disjoint": [],
    "strided_even_odd_disjoint": [],
    "strided_every_second_vs_every_third": [
        ("device-device", "s1", "aten::fill_.Scalar", "s2", "aten::sum"),
    ],
    "column_blocks_disjoint": [],
    "transposed_column_vs_row_tail_disjoint": [],
    "transposed_column_vs_whole_row": [
        ("device-device", "s1", "aten::sum", "s2", "aten::fill_.Scalar"),
    ],
    "select_adjacent_columns_disjoint": [],
    "unbind_rows_disjoint": [],
    "expanded_column_vs_other_column_disjoint": [],
    "expanded_column_vs_same_column": [
        ("device-device", "s1", "aten::sum", "s2", "aten::mul_.Tensor"),
    ],
    "int16_view_write_vs_bfloat16_read": [
        ("device-device", "s1", "aten::bitwise_and_.Scalar", "s2", "aten::sum"),
    ],
    "byte_view_lower_half_vs_upper_half_disjoint": [],
    "byte_view_one_byte_into_upper_half": [
        ("device-device", "s1", "aten::zero_", "s2", "aten::sum"),
    ],
    "unfold_windows_disjoint": [],
    "unfold_windows_overlap": [
        ("device-device", "s1", "aten::sum", "s2", "aten::fill_.Scalar"),
    ],
    "as_strided_quadrants_disjoint": [],
    "as_strided_patch_over_quadrant_corner": [
        ("device-device", "s1", "aten::fill_.Scalar", "s2", "aten::sum"),
    ],
    "reshape_copy_write_vs_original_read": [],
    "reshape_view_write_vs_original_read": [
        ("device-device", "s1", "aten::mul_.Tensor", "s2", "aten::sum"),
    ],
    "pinned_host_writes_outer_rows_during_h2d": [],
    "pinned_host_writes_copied_row_during_h2d": [
        ("host-device", "s1", "aten::copy_", "host", "aten::fill_.Scalar"),
    ],
    "planes_of_3d_disjoint": [],
    "planes_of_3d_crossing": [
        ("device-device", "s1", "aten::fill_.Scalar", "s2", "aten::sum"),
    ],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)
