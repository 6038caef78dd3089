"""One test per rule of docs/semantics.md: small hand-built event sequences fed to the analyzer,
with the exact expected findings (kind, agents, op names, byte range, count) or their exact absence.

Conventions: streams A=1, B=2, C=3 (device 0, non-blocking) unless a test declares others; device memory at
``BASE`` on device 0; pinned host memory at ``PIN`` in space ``PINNED``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from streamsan import events as E
from streamsan.analysis.analyzer import Analyzer
from streamsan.events import (BLOCKING, HOST, LEGACY_DEFAULT, OP_BLOCKING, PINNED, alloc, def_stack,
                              device_sync, event_record, event_sync, event_wait, free, host_access, op,
                              record_stream, rng, stream, stream_sync)
from streamsan.analysis.findings import (ALLOC_REUSE, DEVICE_DEVICE, HOST_DEVICE, MISSING_RECORD_STREAM,
                                fingerprint)
from tests.support.paths import ROOT
from tests.support.rules_kit import BASE, KB, PIN, A, B, C, D, P, base3, check, none, one, run, streams

# ============================================================================ device-device races


def test_write_then_read_on_two_streams_races():
    one(base3() + [op(A, "fill_", writes=[D(0, 4 * KB)]), op(B, "sum", reads=[D(0, 4 * KB)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + 4 * KB, prev_write=True, cur_write=False)


def test_write_then_write_on_two_streams_races():
    one(base3() + [op(A, "fill_", writes=[D(0, 4 * KB)]), op(B, "zero_", writes=[D(0, 4 * KB)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "zero_"), BASE, BASE + 4 * KB, prev_write=True, cur_write=True)


def test_read_then_write_on_two_streams_races():
    one(base3() + [op(A, "sum", reads=[D(0, 4 * KB)]), op(B, "zero_", writes=[D(0, 4 * KB)])],
        DEVICE_DEVICE, (A, "sum"), (B, "zero_"), BASE, BASE + 4 * KB, prev_write=False, cur_write=True)


def test_read_then_read_on_two_streams_no_race():
    none(base3() + [op(A, "sum", reads=[D(0, 4 * KB)]), op(B, "max", reads=[D(0, 4 * KB)]),
                    op(C, "min", reads=[D(0, 4 * KB)])])


def test_op_reading_and_writing_a_range_counts_as_a_write():
    # A's add_ reads and writes x: B's read races with it as with a write.
    one(base3() + [op(A, "add_", reads=[D(0, 256)], writes=[D(0, 256)]), op(B, "sum", reads=[D(0, 256)])],
        DEVICE_DEVICE, (A, "add_"), (B, "sum"), BASE, BASE + 256, prev_write=True, cur_write=False)


def test_same_stream_is_ordered():
    none(base3() + [op(A, "fill_", writes=[D(0, 4 * KB)]), op(A, "sum", reads=[D(0, 4 * KB)]),
                    op(A, "zero_", writes=[D(0, 4 * KB)]), op(A, "add_", reads=[D(0, 64)], writes=[D(0, 64)])])


def test_host_sync_then_enqueue_orders_streams():
    # VC[B] joins VC[host] on enqueue: A's write is ordered before B's read once the host synchronized A.
    none(base3() + [op(A, "fill_", writes=[D(0, 64)]), stream_sync(A), op(B, "sum", reads=[D(0, 64)])])


def test_empty_and_zero_size_ranges_never_race():
    none(base3() + [op(A, "fill_", writes=[D(0, 0)]), op(B, "zero_", writes=[D(0, 0)]), op(B, "noop")])


def test_same_address_in_different_spaces_no_race():
    evs = (streams(A) + streams(B, device=1)
           + [alloc(0, BASE, 256, A), alloc(1, BASE, 256, B), alloc(PINNED, BASE, 256, HOST),
              op(A, "fill_", writes=[rng(0, BASE, 256)]), op(B, "fill_", writes=[rng(1, BASE, 256)]),
              host_access("cpu_write", writes=[rng(PINNED, BASE, 256)])])
    none(evs)


# ============================================================================ events


def test_event_record_wait_orders():
    none(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_record(7, A), event_wait(7, B),
                    op(B, "sum", reads=[D(0, 64)]), op(B, "zero_", writes=[D(0, 64)])])


def test_event_orders_only_work_before_the_record():
    one(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_record(7, A), op(A, "copy_", writes=[D(64, 64)]),
                   event_wait(7, B), op(B, "sum", reads=[D(0, 64)]), op(B, "max", reads=[D(64, 64)])],
        DEVICE_DEVICE, (A, "copy_"), (B, "max"), BASE + 64, BASE + 128)


def test_event_wait_is_not_symmetric():
    # B waited for A; A did not wait for B: A's later write races with B's read.
    one(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_record(7, A), event_wait(7, B),
                   op(B, "sum", reads=[D(0, 64)]), op(A, "zero_", writes=[D(0, 64)])],
        DEVICE_DEVICE, (B, "sum"), (A, "zero_"), BASE, BASE + 64, prev_write=False, cur_write=True)


def test_wait_on_never_recorded_event_adds_no_edge():
    one(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_wait(7, B), op(B, "sum", reads=[D(0, 64)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + 64)


def test_rerecorded_event_denotes_the_latest_record():
    none(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_record(7, A), op(A, "copy_", writes=[D(64, 64)]),
                    event_record(7, A), event_wait(7, B), op(B, "sum", reads=[D(0, 128)])])


def test_wait_before_rerecord_sees_only_the_first_record():
    one(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_record(7, A), event_wait(7, B),
                   op(A, "copy_", writes=[D(64, 64)]), event_record(7, A), op(B, "sum", reads=[D(0, 128)])],
        DEVICE_DEVICE, (A, "copy_"), (B, "sum"), BASE + 64, BASE + 128)


def test_rerecording_on_another_stream_replaces_the_event():
    # E recorded on A after the write, then re-recorded on C: waiting on E orders B after C only.
    one(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_record(7, A), event_record(7, C), event_wait(7, B),
                   op(B, "sum", reads=[D(0, 64)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + 64)


def test_wait_stream_is_record_plus_wait():
    # B.wait_stream(A) fires event_creation, event_record(e, A), event_wait(e, B), event_deletion.
    none(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_record(9, A), event_wait(9, B), E.event_delete(9),
                    op(B, "sum", reads=[D(0, 64)])])


def test_event_edges_are_transitive():
    none(base3() + [op(A, "fill_", writes=[D(0, 64)]), event_record(7, A), event_wait(7, B),
                    op(B, "noop"), event_record(8, B), event_wait(8, C), op(C, "sum", reads=[D(0, 64)])])


# ============================================================================ host <-> device (pinned memory)


def pinned2():
    return streams(A, B) + [alloc(PINNED, PIN, 1 * KB, HOST, what="float32[256]")]


def test_host_read_of_pinned_after_stream_write_races():
    # x.to("cpu", non_blocking=True) then reading it on the CPU without a sync
    one(pinned2() + [op(A, "copy_d2h", writes=[P(0, 1 * KB)]), host_access("cpu_read", reads=[P(0, 1 * KB)])],
        HOST_DEVICE, (A, "copy_d2h"), (HOST, "cpu_read"), PIN, PIN + 1 * KB, space=PINNED,
        prev_write=True, cur_write=False)


def test_host_write_of_pinned_after_stream_write_races():
    one(pinned2() + [op(A, "copy_d2h", writes=[P(0, 1 * KB)]), host_access("cpu_fill", writes=[P(0, 1 * KB)])],
        HOST_DEVICE, (A, "copy_d2h"), (HOST, "cpu_fill"), PIN, PIN + 1 * KB, space=PINNED)


@pytest.mark.parametrize("sync", ["stream_sync", "event_sync", "device_sync", "op_blocking"])
def test_host_access_after_synchronized_stream_write_no_race(sync):
    evs = pinned2()
    if sync == "op_blocking":
        evs.append(op(A, "copy_d2h", writes=[P(0, 1 * KB)], flags=OP_BLOCKING))
    else:
        evs.append(op(A, "copy_d2h", writes=[P(0, 1 * KB)]))
        evs += {"stream_sync": [stream_sync(A)],
                "event_sync": [event_record(3, A), event_sync(3)],
                "device_sync": [device_sync(0)]}[sync]
    evs += [host_access("cpu_read", reads=[P(0, 1 * KB)]), host_access("cpu_fill", writes=[P(0, 1 * KB)])]
    none(evs)


def test_event_sync_on_event_recorded_before_the_write_races():
    one(pinned2() + [event_record(3, A), op(A, "copy_d2h", writes=[P(0, 256)]), event_sync(3),
                     host_access("cpu_read", reads=[P(0, 256)])],
        HOST_DEVICE, (A, "copy_d2h"), (HOST, "cpu_read"), PIN, PIN + 256, space=PINNED)


def test_event_sync_on_never_recorded_event_races():
    one(pinned2() + [op(A, "copy_d2h", writes=[P(0, 256)]), event_sync(3),
                     host_access("cpu_read", reads=[P(0, 256)])],
        HOST_DEVICE, (A, "copy_d2h"), (HOST, "cpu_read"), PIN, PIN + 256, space=PINNED)


def test_stream_sync_of_another_stream_does_not_order():
    one(pinned2() + [op(A, "copy_d2h", writes=[P(0, 256)]), stream_sync(B),
                     host_access("cpu_read", reads=[P(0, 256)])],
        HOST_DEVICE, (A, "copy_d2h"), (HOST, "cpu_read"), PIN, PIN + 256, space=PINNED)


def test_blocking_op_orders_only_itself_and_earlier_work():
    # the host waits right after the blocking op; a later non-blocking op on the same stream is not waited for
    one(pinned2() + [op(A, "copy_d2h", writes=[P(0, 256)], flags=OP_BLOCKING), op(A, "copy_d2h_2", writes=[P(0, 256)]),
                     host_access("cpu_read", reads=[P(0, 256)])],
        HOST_DEVICE, (A, "copy_d2h_2"), (HOST, "cpu_read"), PIN, PIN + 256, space=PINNED)


def test_blocking_op_reading_pinned_orders_a_later_host_write():
    none(pinned2() + [op(A, "copy_h2d", reads=[P(0, 256)], flags=OP_BLOCKING),
                      host_access("cpu_fill", writes=[P(0, 256)])])


def test_host_write_then_h2d_read_is_ordered_by_enqueue():
    none(pinned2() + [host_access("cpu_fill", writes=[P(0, 1 * KB)]), op(A, "copy_h2d", reads=[P(0, 1 * KB)]),
                      host_access("cpu_read", reads=[P(0, 1 * KB)]), op(B, "copy_h2d", reads=[P(0, 1 * KB)])])


def test_host_write_after_enqueued_read_races():
    one(pinned2() + [host_access("cpu_fill", writes=[P(0, 1 * KB)]), op(A, "copy_h2d", reads=[P(0, 1 * KB)]),
                     host_access("cpu_fill_2", writes=[P(0, 1 * KB)])],
        HOST_DEVICE, (A, "copy_h2d"), (HOST, "cpu_fill_2"), PIN, PIN + 1 * KB, space=PINNED,
        prev_write=False, cur_write=True)


def test_host_write_after_enqueued_read_and_sync_no_race():
    none(pinned2() + [op(A, "copy_h2d", reads=[P(0, 1 * KB)]), stream_sync(A),
                      host_access("cpu_fill", writes=[P(0, 1 * KB)])])


def test_d2h_then_h2d_on_unsynchronized_streams_races():
    # The offloading cache of transformers 5.17: offload() D2H on the default stream, prefetch() H2D from the same pinned
    # buffer on the prefetch stream, which never waited for the default stream.
    one(pinned2() + [op(A, "offload_copy_", writes=[P(0, 1 * KB)]), op(B, "prefetch_copy_", reads=[P(0, 1 * KB)])],
        DEVICE_DEVICE, (A, "offload_copy_"), (B, "prefetch_copy_"), PIN, PIN + 1 * KB, space=PINNED)


def test_device_sync_orders_only_streams_of_that_device():
    evs = (streams(A) + streams(B, device=1)
           + [alloc(PINNED, PIN, 1 * KB, HOST),
              op(A, "copy_d2h", writes=[P(0, 256)]), op(B, "copy_d2h", writes=[P(256, 256)]),
              device_sync(0),
              host_access("cpu_read_a", reads=[P(0, 256)]), host_access("cpu_read_b", reads=[P(256, 256)])])
    one(evs, HOST_DEVICE, (B, "copy_d2h"), (HOST, "cpu_read_b"), PIN + 256, PIN + 512, space=PINNED)


def test_device_sync_of_other_device_then_enqueue_does_not_order():
    evs = (streams(A, C) + streams(B, device=1)
           + [alloc(0, BASE, 256, A), op(A, "fill_", writes=[D(0, 256)]), device_sync(1),
              op(C, "sum", reads=[D(0, 256)])])
    one(evs, DEVICE_DEVICE, (A, "fill_"), (C, "sum"), BASE, BASE + 256)


# ============================================================================ byte ranges


def test_disjoint_subranges_of_one_block_no_race():
    none(base3() + [op(A, "fill_", writes=[D(0, 2 * KB)]), op(B, "fill_", writes=[D(2 * KB, 2 * KB)]),
                    op(A, "sum", reads=[D(0, 2 * KB)]), op(B, "sum", reads=[D(2 * KB, 2 * KB)])])


def test_adjacent_subranges_do_not_overlap():
    none(base3() + [op(A, "fill_", writes=[D(0, 100)]), op(B, "zero_", writes=[D(100, 100)]),
                    op(B, "sum", reads=[D(100, 1)])])


def test_overlapping_subranges_at_different_offsets_race_on_the_overlap():
    one(base3() + [op(A, "fill_", writes=[D(0, 1 * KB)]), op(B, "zero_", writes=[D(768, 1 * KB)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "zero_"), BASE + 768, BASE + 1 * KB)


def test_overlapping_read_inside_write_races_on_the_read_range():
    one(base3() + [op(A, "fill_", writes=[D(0, 4 * KB)]), op(B, "sum", reads=[D(1000, 24)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE + 1000, BASE + 1024)


# ============================================================================ strided views
# x: float32[N, 128] at BASE, row-major. A view's range: (start, extent, (itemsize, sizes, strides)).
N = 8
ROW = 128 * 4


def xview(col0, ncols, rows=N):
    """x[:rows, col0:col0+ncols] of a float32[N, 128] tensor at BASE."""
    return D(col0 * 4, ((rows - 1) * 128 + ncols) * 4, (4, (rows, ncols), (128, 1)))


def test_strided_disjoint_column_halves_no_race():
    none(streams(A, B) + [alloc(0, BASE, N * ROW, A), op(A, "fill_", writes=[xview(0, 64)]),
                          op(B, "fill_", writes=[xview(64, 64)]), op(A, "sum", reads=[xview(0, 64)]),
                          op(B, "sum", reads=[xview(64, 64)])])


def test_strided_overlapping_columns_race():
    # x[:, :65] and x[:, 64:] share column 64. The finding's range is where the shadow found the conflict: the
    # intersection of the two extents, [BASE + 64*4, end of x[:, :65]'s extent).
    one(streams(A, B) + [alloc(0, BASE, N * ROW, A), op(A, "fill_", writes=[xview(0, 65)]),
                         op(B, "fill_", writes=[xview(64, 64)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "fill_"), BASE + 64 * 4, BASE + ((N - 1) * 128 + 65) * 4)


def test_strided_write_vs_dense_read_of_a_gap_no_race():
    # x[:, 64:] written on A; B densely reads row 1's first half, which lies inside the extent of x[:, 64:] but
    # touches none of its elements.
    none(streams(A, B) + [alloc(0, BASE, N * ROW, A), op(A, "fill_", writes=[xview(64, 64)]),
                          op(B, "sum", reads=[D(ROW, 64 * 4)])])


def test_strided_write_vs_dense_read_of_an_element_races():
    one(streams(A, B) + [alloc(0, BASE, N * ROW, A), op(A, "fill_", writes=[xview(64, 64)]),
                         op(B, "sum", reads=[D(ROW + 60 * 4, 8 * 4)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE + ROW + 60 * 4, BASE + ROW + 68 * 4)


def test_transpose_vs_original_races():
    # x: float32[4, 4]; x.t() has sizes (4, 4), strides (1, 4) and the same bytes.
    t = rng(0, BASE, 64, (4, (4, 4), (1, 4)))
    one(streams(A, B) + [alloc(0, BASE, 64, A), op(A, "fill_", writes=[rng(0, BASE, 64)]),
                         op(B, "sum", reads=[t])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + 64)


def test_transposed_write_vs_strided_write_races():
    t = rng(0, BASE, 64, (4, (4, 4), (1, 4)))
    one(streams(A, B) + [alloc(0, BASE, 64, A), op(A, "fill_", writes=[rng(0, BASE + 4, 52, (4, (4,), (4,)))]),
                         op(B, "copy_", writes=[t])],
        DEVICE_DEVICE, (A, "fill_"), (B, "copy_"), BASE + 4, BASE + 56)


def test_column_vs_row_segment_of_a_square_matrix():
    # x[:, 0] (stride 4 elements) and x[1, 1:] do not share an element; x[1, :] does (x[1, 0]).
    col0 = rng(0, BASE, 52, (4, (4,), (4,)))
    none(streams(A, B) + [alloc(0, BASE, 64, A), op(A, "fill_", writes=[col0]),
                          op(B, "sum", reads=[rng(0, BASE + 20, 12)])])
    one(streams(A, B) + [alloc(0, BASE, 64, A), op(A, "fill_", writes=[col0]),
                         op(B, "sum", reads=[rng(0, BASE + 16, 16)])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE + 16, BASE + 32)


def test_expanded_read_of_written_row_races():
    # y: float32[1, 128] written on A; B reads y.expand(8, 128): sizes (8, 128), strides (0, 1).
    one(streams(A, B) + [alloc(0, BASE, ROW, A), op(A, "fill_", writes=[D(0, ROW)]),
                         op(B, "sum", reads=[D(0, ROW, (4, (8, 128), (0, 1)))])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + ROW)


def test_expanded_read_of_another_column_no_race():
    # x: float32[4, 4]; A writes x[:, 1]; B reads x[:, 0:1].expand(4, 3) (strides (4, 0)): the extents overlap
    # but no element is shared.
    col1 = rng(0, BASE + 4, 52, (4, (4,), (4,)))
    exp0 = rng(0, BASE, 52, (4, (4, 3), (4, 0)))
    none(streams(A, B) + [alloc(0, BASE, 64, A), op(A, "fill_", writes=[col1]), op(B, "sum", reads=[exp0])])


def test_expanded_read_of_the_written_column_races():
    col1 = rng(0, BASE + 4, 52, (4, (4,), (4,)))
    exp1 = rng(0, BASE + 4, 52, (4, (4, 3), (4, 0)))
    one(streams(A, B) + [alloc(0, BASE, 64, A), op(A, "fill_", writes=[col1]), op(B, "sum", reads=[exp1])],
        DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE + 4, BASE + 56)


def test_expanded_read_ordered_after_the_write_no_race():
    # (an ordered pair never needs the element-level check, so the stride-0 layout is harmless here)
    none(streams(A, B) + [alloc(0, BASE, ROW, A), op(A, "fill_", writes=[D(0, ROW)]), event_record(1, A),
                          event_wait(1, B), op(B, "sum", reads=[D(0, ROW, (4, (8, 128), (0, 1)))])])


def test_strided_write_keeps_the_bytes_it_did_not_overwrite():
    # A writes all of x; C (after A) overwrites x[:, :64]; B (unordered with A) reads x[:, 64:]: A's write of
    # those bytes is still the last one, and races.
    # (A's dense write covers exactly the extent of x[:, :64], so the shadow is one interval there; see
    # test_one_racing_pair_counts_once_however_the_shadow_is_fragmented for what fragmentation does)
    ext = xview(0, 64)[2]
    evs = streams(A, B, C) + [alloc(0, BASE, N * ROW, A), op(A, "fill_", writes=[D(0, ext)]),
                              event_record(1, A), event_wait(1, C), op(C, "zero_", writes=[xview(0, 64)]),
                              op(B, "sum", reads=[xview(64, 64)])]
    one(evs, DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE + 64 * 4, BASE + ext)


def test_strided_write_ordered_chain_no_race():
    evs = streams(A, B, C) + [alloc(0, BASE, N * ROW, A), op(A, "fill_", writes=[D(0, N * ROW)]),
                              event_record(1, A), event_wait(1, C), op(C, "zero_", writes=[xview(0, 64)]),
                              event_record(2, C), event_wait(2, B), op(B, "sum", reads=[D(0, N * ROW)])]
    none(evs)


NN = 32  # y: float32[NN, 128] at BASE


def yview(r0, r1, c0, c1):
    """y[r0:r1, c0:c1] of a float32[NN, 128] tensor at BASE."""
    rows, cols = r1 - r0, c1 - c0
    return D((r0 * 128 + c0) * 4, ((rows - 1) * 128 + cols) * 4, (4, (rows, cols), (128, 1)))


def test_each_unordered_strided_write_of_a_range_races_with_a_later_write():
    """Two ops of A wrote disjoint columns (one shadow range holds both where their extents overlap); B overwrites
    rows 1-6 without waiting: two races."""
    a = run(streams(A, B) + [alloc(0, BASE, N * ROW, A), op(A, "fill_left", writes=[xview(0, 64)]),
                             op(A, "fill_right", writes=[xview(64, 64)]), op(B, "zero_", writes=[D(ROW, 6 * ROW)])])
    assert [(f.kind, f.previous.name, f.current.name, f.count) for f in a.sorted_findings()] == [
        (DEVICE_DEVICE, "fill_left", "zero_", 1), (DEVICE_DEVICE, "fill_right", "zero_", 1)]


def test_each_unordered_reader_stream_races_with_a_later_write():
    """B and C read what A then overwrites without waiting for either: one race per reader stream."""
    a = run(base3() + [op(B, "sum", reads=[D(0, KB)]), op(C, "max", reads=[D(0, KB)]),
                       op(A, "zero_", writes=[D(0, KB)])])
    assert [(f.kind, f.previous.agent, f.previous.name, f.current.name) for f in a.sorted_findings()] == [
        (DEVICE_DEVICE, B, "sum", "zero_"), (DEVICE_DEVICE, C, "max", "zero_")]


def test_many_strided_reads_do_not_hide_an_older_strided_read():
    # B reads y[:, 1:64]; A (after waiting for B) reads 17 different column-0 views y[:r, 0]; C writes y[1, 1]
    # without waiting for B: byte y[1, 1] is read by B and written by C, unordered.
    evs = streams(A, B, C) + [alloc(0, BASE, NN * ROW, A), op(B, "x_read", reads=[yview(0, NN, 1, 64)]),
                              event_record(1, B), event_wait(1, A)]
    evs += [op(A, "col0_read", reads=[yview(0, r, 0, 1)]) for r in range(NN, NN - 17, -1)]
    evs += [op(C, "write_y11", writes=[D(ROW + 4, 4)])]
    one(evs, DEVICE_DEVICE, (B, "x_read"), (C, "write_y11"), BASE + ROW + 4, BASE + ROW + 8)


def test_many_strided_writes_do_not_hide_an_older_strided_write():
    evs = streams(A, B, C) + [alloc(0, BASE, NN * ROW, A), op(B, "x_write", writes=[yview(0, NN, 1, 64)]),
                              event_record(1, B), event_wait(1, A)]
    evs += [op(A, "col0_write", writes=[yview(0, r, 0, 1)]) for r in range(NN, NN - 16, -1)]
    evs += [op(C, "read_y11", reads=[D(ROW + 4, 4)])]
    one(evs, DEVICE_DEVICE, (B, "x_write"), (C, "read_y11"), BASE + ROW + 4, BASE + ROW + 8)


def test_a_few_strided_accesses_keep_the_older_one():
    # the same shapes as the two tests above, below the bound: found
    for k, kind in ((15, "read"), (15, "write")):
        first = (op(B, "x_read", reads=[yview(0, NN, 1, 64)]) if kind == "read"
                 else op(B, "x_write", writes=[yview(0, NN, 1, 64)]))
        evs = streams(A, B, C) + [alloc(0, BASE, NN * ROW, A), first, event_record(1, B), event_wait(1, A)]
        if kind == "read":
            evs += [op(A, "col0_read", reads=[yview(0, r, 0, 1)]) for r in range(NN, NN - k, -1)]
            evs += [op(C, "write_y11", writes=[D(ROW + 4, 4)])]
            one(evs, DEVICE_DEVICE, (B, "x_read"), (C, "write_y11"), BASE + ROW + 4, BASE + ROW + 8)
        else:
            evs += [op(A, "col0_write", writes=[yview(0, r, 0, 1)]) for r in range(NN, NN - k, -1)]
            evs += [op(C, "read_y11", reads=[D(ROW + 4, 4)])]
            one(evs, DEVICE_DEVICE, (B, "x_write"), (C, "read_y11"), BASE + ROW + 4, BASE + ROW + 8)


# ============================================================================ legacy default stream
L, BL, BL2, NB = 1, 2, 3, 4


def legacy_streams():
    return [stream(L, 0, 0, LEGACY_DEFAULT, "default"), stream(BL, 0, 0x100, BLOCKING, "cupy1"),
            stream(BL2, 0, 0x200, BLOCKING, "cupy2"), stream(NB, 0, 0x300, 0, "side"),
            alloc(0, BASE, 4 * KB, L)]


def test_legacy_default_then_blocking_stream_ordered():
    none(legacy_streams() + [op(L, "fill_", writes=[D(0, 64)]), op(BL, "sum", reads=[D(0, 64)]),
                             op(BL, "zero_", writes=[D(0, 64)])])


def test_blocking_stream_then_legacy_default_ordered():
    none(legacy_streams() + [op(BL, "fill_", writes=[D(0, 64)]), op(L, "sum", reads=[D(0, 64)]),
                             op(L, "zero_", writes=[D(0, 64)])])


def test_blocking_stream_write_after_legacy_read_ordered():
    none(legacy_streams() + [op(L, "sum", reads=[D(0, 64)]), op(BL, "zero_", writes=[D(0, 64)])])


def test_non_blocking_stream_not_ordered_with_legacy_default():
    a = run(legacy_streams() + [op(L, "fill_", writes=[D(0, 64)]), op(NB, "sum", reads=[D(0, 64)]),
                                op(NB, "copy_", writes=[D(64, 64)]), op(L, "max", reads=[D(64, 64)])])
    fs = a.sorted_findings()
    assert len(fs) == 2, fs
    check(fs[0], DEVICE_DEVICE, (L, "fill_"), (NB, "sum"), BASE, BASE + 64)
    check(fs[1], DEVICE_DEVICE, (NB, "copy_"), (L, "max"), BASE + 64, BASE + 128)


def test_two_blocking_streams_not_ordered_directly():
    one(legacy_streams() + [op(BL, "fill_", writes=[D(0, 64)]), op(BL2, "sum", reads=[D(0, 64)])],
        DEVICE_DEVICE, (BL, "fill_"), (BL2, "sum"), BASE, BASE + 64)


def test_two_blocking_streams_ordered_through_legacy_work():
    none(legacy_streams() + [op(BL, "fill_", writes=[D(0, 64)]), op(L, "noop"), op(BL2, "sum", reads=[D(0, 64)])])


def test_legacy_edge_covers_only_work_enqueued_before():
    # L's op is enqueued before BL's write: the implicit edge BL -> L does not reach back to it.
    one(legacy_streams() + [op(L, "sum", reads=[D(0, 64)]), op(BL, "zero_", writes=[D(64, 64)]),
                            op(NB, "noop"), op(NB, "max", reads=[D(64, 64)])],
        DEVICE_DEVICE, (BL, "zero_"), (NB, "max"), BASE + 64, BASE + 128)


def test_legacy_default_of_another_device_does_not_order():
    evs = [stream(L, 1, 0, LEGACY_DEFAULT, "default1"), stream(BL, 0, 0x100, BLOCKING, "cupy0"),
           stream(BL2, 0, 0x200, BLOCKING, "cupy0b"), alloc(0, BASE, 4 * KB, BL),
           op(BL, "fill_", writes=[D(0, 64)]), op(L, "noop"), op(BL2, "sum", reads=[D(0, 64)])]
    one(evs, DEVICE_DEVICE, (BL, "fill_"), (BL2, "sum"), BASE, BASE + 64)


def test_legacy_event_record_is_work_too():
    # an event record on L is enqueued work: it orders after BL's earlier write, and so does its waiter
    none(legacy_streams() + [op(BL, "fill_", writes=[D(0, 64)]), event_record(5, L), event_wait(5, NB),
                             op(NB, "sum", reads=[D(0, 64)])])


# ============================================================================ missing record_stream
P_OFF, Q_OFF = 0, 8 * KB  # block P at BASE (1 KiB), a non-overlapping block Q at BASE + 8 KiB


def mrs_prefix():
    """P allocated on A, written by A, read by B (after waiting for A), then freed."""
    return streams(A, B, C) + [
        alloc(0, BASE, 1 * KB, A, what="float32[256]"),
        op(A, "copy_h2d", writes=[D(0, 1 * KB)]),
        event_record(1, A), event_wait(1, B),
        op(B, "cat", reads=[D(0, 1 * KB)]),
        free(0, BASE),
    ]


def test_missing_record_stream_next_allocation_elsewhere():
    a, f = one(mrs_prefix() + [alloc(0, BASE + Q_OFF, 1 * KB, A)],
               MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB,
               prev_write=False)
    assert f.reused is False
    assert f.block is None
    assert (f.prev_block.start, f.prev_block.size, f.prev_block.owner, f.prev_block.freed) == (BASE, 1 * KB, A, True)
    assert [o.kind for o in a.occurrences] == [MISSING_RECORD_STREAM]


def test_missing_record_stream_block_really_reused():
    a, f = one(mrs_prefix() + [alloc(0, BASE, 512, A)],
               MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    assert f.reused is True
    assert (f.block.start, f.block.size, f.block.owner, f.block.freed) == (BASE, 512, A, False)
    assert f.prev_block is not f.block


def test_missing_record_stream_met_first_without_reuse_names_the_block_handed_on_later():
    """The same missing record_stream twice (a loop): the first time A's next allocation got other memory, the
    second time the freed block itself. The finding says the block was reused, and names the allocation that got
    it (before, "reused" came with no allocation: the report said streamsan had not seen it allocated)."""
    again = [alloc(0, BASE + 4 * KB, 1 * KB, A), op(A, "copy_h2d", writes=[D(4 * KB, 1 * KB)]),
             event_record(2, A), event_wait(2, B), op(B, "cat", reads=[D(4 * KB, 1 * KB)]), free(0, BASE + 4 * KB),
             alloc(0, BASE + 4 * KB, 1 * KB, A)]
    _, f = one(mrs_prefix() + [alloc(0, BASE + Q_OFF, 1 * KB, A)] + again,
               MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB, count=2)
    assert f.reused is True
    assert (f.block.start, f.block.size, f.block.owner) == (BASE + 4 * KB, 1 * KB, A)


def test_missing_record_stream_partial_overlap_counts_as_reuse():
    _, f = one(mrs_prefix() + [alloc(0, BASE + 768, 1 * KB, A)],
               MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    assert f.reused is True


def test_missing_record_stream_foreign_write():
    evs = streams(A, B) + [alloc(0, BASE, 1 * KB, A), op(B, "copy_", writes=[D(0, 1 * KB)]), free(0, BASE),
                           alloc(0, BASE + Q_OFF, 64, A)]
    one(evs, MISSING_RECORD_STREAM, (B, "copy_"), (A, "allocation"), BASE, BASE + 1 * KB, prev_write=True)


def test_missing_record_stream_reports_the_last_foreign_access():
    # A waited for B's first read only; B's second read is still pending at the allocation.
    evs = streams(A, B) + [alloc(0, BASE, 1 * KB, A), op(B, "cat", reads=[D(0, 1 * KB)]), event_record(2, B),
                           op(B, "cat_2", reads=[D(0, 512)]), event_wait(2, A), free(0, BASE),
                           alloc(0, BASE + Q_OFF, 64, A)]
    one(evs, MISSING_RECORD_STREAM, (B, "cat_2"), (A, "allocation"), BASE, BASE + 1 * KB)


def test_missing_record_stream_folds_the_foreign_streams_earlier_accesses():
    # B writes the block in place, then reads it last (an offloaded static cache layer); the reuse on A races with
    # both, and both are the one missing record_stream: no separate alloc-reuse finding for the write.
    evs = streams(A, B) + [alloc(0, BASE, 1 * KB, A), op(A, "h2d", writes=[D(0, 1 * KB)]), event_record(1, A),
                           event_wait(1, B), op(B, "index_copy_", writes=[D(0, 512)]),
                           op(B, "bmm", reads=[D(0, 1 * KB)]), free(0, BASE),
                           alloc(0, BASE, 1 * KB, A), op(A, "h2d", writes=[D(0, 1 * KB)])]
    a, f = one(evs, MISSING_RECORD_STREAM, (B, "bmm"), (A, "allocation"), BASE, BASE + 1 * KB)
    assert f.reused is True
    assert sorted((o.kind, o.folded) for o in a.occurrences) == [
        (ALLOC_REUSE, True), (ALLOC_REUSE, True), (MISSING_RECORD_STREAM, False)]


def test_missing_record_stream_folding_leaves_a_recorded_stream_ordered():
    # C recorded the block (the allocator waits for its write); only B's read is the missing record_stream.
    evs = streams(A, B, C) + [alloc(0, BASE, 1 * KB, A), op(C, "fill_", writes=[D(0, 512)]),
                              op(B, "bmm", reads=[D(512, 512)]), record_stream(0, BASE, C), free(0, BASE),
                              alloc(0, BASE, 1 * KB, A), op(A, "h2d", writes=[D(0, 1 * KB)])]
    a = run(evs)
    assert [(f.kind, f.previous.name, f.current.name) for f in a.sorted_findings()] == [
        (MISSING_RECORD_STREAM, "bmm", "allocation")]


def test_missing_record_stream_one_finding_per_foreign_stream():
    evs = streams(A, B, C) + [alloc(0, BASE, 1 * KB, A), op(B, "cat", reads=[D(0, 512)]),
                              op(C, "add", reads=[D(512, 512)]), free(0, BASE), alloc(0, BASE + Q_OFF, 64, A)]
    a = run(evs)
    fs = a.sorted_findings()
    assert len(fs) == 2, fs
    check(fs[0], MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    check(fs[1], MISSING_RECORD_STREAM, (C, "add"), (A, "allocation"), BASE, BASE + 1 * KB)


def test_missing_record_stream_reported_once_not_at_every_allocation():
    _, f = one(mrs_prefix() + [alloc(0, BASE + Q_OFF, 64, A), alloc(0, BASE + Q_OFF + KB, 64, A),
                               alloc(0, BASE, 64, A)],
               MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    assert f.current.seq == len(mrs_prefix())


def test_record_stream_suppresses_missing_record_stream():
    evs = mrs_prefix()
    evs.insert(len(evs) - 1, record_stream(0, BASE, B))
    none(evs + [alloc(0, BASE, 1 * KB, A), op(A, "copy_h2d", writes=[D(0, 1 * KB)])])


def test_record_stream_does_nothing_to_another_librarys_pool():
    """A torch tensor over CuPy memory (DLPack): PyTorch's record_stream marks only its own allocator's blocks, so
    the CuPy pool's next allocation on the owner stream still races with the other stream's read."""
    evs = streams(A, B) + [alloc(0, BASE, 1 * KB, A, pool=E.FOREIGN_POOL), op(B, "cat", reads=[D(0, KB)]),
                           record_stream(0, BASE, B), free(0, BASE), alloc(0, BASE, 1 * KB, A, pool=E.FOREIGN_POOL)]
    one(evs, MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    # (its pool's free lists are its own: PyTorch's next allocation on A does not take the block)
    none(evs[:-1] + [alloc(0, BASE + Q_OFF, 64, A)])


def test_record_stream_before_the_foreign_access_suppresses_too():
    evs = streams(A, B) + [alloc(0, BASE, 1 * KB, A), record_stream(0, BASE, B), op(B, "cat", reads=[D(0, KB)]),
                           free(0, BASE), alloc(0, BASE + Q_OFF, 64, A)]
    none(evs)


def test_record_stream_on_a_view_inside_the_block_suppresses():
    # t[1:].record_stream(B): the view's data pointer is inside the block
    evs = mrs_prefix()
    evs.insert(len(evs) - 1, record_stream(0, BASE + 256, B))
    none(evs + [alloc(0, BASE, 1 * KB, A), op(A, "copy_h2d", writes=[D(0, 1 * KB)])])


def test_record_stream_of_another_stream_does_not_suppress():
    evs = mrs_prefix()
    evs.insert(len(evs) - 1, record_stream(0, BASE, C))
    one(evs + [alloc(0, BASE + Q_OFF, 64, A)], MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"),
        BASE, BASE + 1 * KB)


def test_owner_waits_for_user_before_free_no_missing_record_stream():
    evs = mrs_prefix()
    evs[-1:-1] = [event_record(2, B), event_wait(2, A)]  # A.wait_stream(B) before the free
    none(evs + [alloc(0, BASE, 1 * KB, A), op(A, "copy_h2d", writes=[D(0, 1 * KB)])])


def test_owner_waits_for_user_after_free_before_allocation_no_missing_record_stream():
    none(mrs_prefix() + [event_record(2, B), event_wait(2, A), alloc(0, BASE, 1 * KB, A),
                         op(A, "copy_h2d", writes=[D(0, 1 * KB)])])


@pytest.mark.parametrize("where", ["before_free", "after_free"])
@pytest.mark.parametrize("sync", ["stream_sync", "device_sync", "event_sync"])
def test_host_sync_of_user_no_missing_record_stream(where, sync):
    syncs = {"stream_sync": [stream_sync(B)], "device_sync": [device_sync(0)],
             "event_sync": [event_record(4, B), event_sync(4)]}[sync]
    evs = mrs_prefix()
    if where == "before_free":
        evs[-1:-1] = syncs
    else:
        evs += syncs
    none(evs + [alloc(0, BASE, 1 * KB, A), op(A, "copy_h2d", writes=[D(0, 1 * KB)])])


def test_freed_block_never_reallocated_on_owner_no_finding():
    none(mrs_prefix() + [op(A, "noop"), op(B, "noop")])


def test_allocation_on_another_stream_does_not_trigger_missing_record_stream():
    a = run(mrs_prefix() + [alloc(0, BASE + Q_OFF, 64, C), alloc(0, BASE + Q_OFF + KB, 64, B)])
    assert a.sorted_findings() == []
    # ... and the block is still pending for A's next allocation
    a.feed([alloc(0, BASE + 2 * Q_OFF, 64, A)])
    fs = a.sorted_findings()
    assert len(fs) == 1
    check(fs[0], MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)


def test_owner_own_accesses_and_host_are_not_foreign():
    evs = (streams(A) + [alloc(0, BASE, 1 * KB, A), op(A, "fill_", writes=[D(0, KB)]),
                         op(A, "sum", reads=[D(0, KB)]), free(0, BASE), alloc(0, BASE, 1 * KB, A),
                         op(A, "fill_", writes=[D(0, KB)])])
    none(evs)


def test_pinned_memory_has_no_missing_record_stream():
    evs = pinned2() + [op(A, "copy_h2d", reads=[P(0, 1 * KB)]), free(PINNED, PIN),
                       alloc(PINNED, PIN, 1 * KB, HOST)]
    none(evs)


# ============================================================================ alloc-reuse


def reuse_prefix():
    """Block P on A, written by A, freed, reallocated (same bytes) on A."""
    return streams(A, B, C) + [alloc(0, BASE, 1 * KB, A, what="old"), op(A, "fill_", writes=[D(0, 1 * KB)]),
                               free(0, BASE), alloc(0, BASE, 1 * KB, A, what="new")]


def test_alloc_reuse_race_with_old_life():
    a, f = one(reuse_prefix() + [op(C, "zero_", writes=[D(0, 1 * KB)])],
               ALLOC_REUSE, (A, "fill_"), (C, "zero_"), BASE, BASE + 1 * KB, prev_write=True, cur_write=True)
    assert f.prev_block.what == "old" and f.prev_block.freed
    assert f.block.what == "new" and not f.block.freed
    assert f.previous.seq < f.block.seq  # made in the earlier life


def test_alloc_reuse_finding_names_both_lives_labels():
    evs = streams(A, C) + [alloc(0, BASE, 1 * KB, A, what="float32[256]"), E.label(0, BASE, KB, "cache.keys"),
                           op(A, "fill_", writes=[D(0, 1 * KB)]), free(0, BASE),
                           alloc(0, BASE, 1 * KB, A, what="bfloat16[512]"), E.label(0, BASE, KB, "cache.values"),
                           op(C, "zero_", writes=[D(0, 1 * KB)])]
    _, f = one(evs, ALLOC_REUSE, (A, "fill_"), (C, "zero_"), BASE, BASE + 1 * KB)
    assert (f.prev_block.what, f.prev_block.label) == ("float32[256]", "cache.keys")
    assert (f.block.what, f.block.label) == ("bfloat16[512]", "cache.values")


def test_alloc_reuse_read_of_new_life_races_with_old_write():
    one(reuse_prefix() + [op(C, "sum", reads=[D(256, 256)])],
        ALLOC_REUSE, (A, "fill_"), (C, "sum"), BASE + 256, BASE + 512)


def test_alloc_reuse_new_allocation_partially_overlapping():
    evs = streams(A, C) + [alloc(0, BASE, 1 * KB, A), op(A, "fill_", writes=[D(0, 1 * KB)]), free(0, BASE),
                           alloc(0, BASE + 512, 1 * KB, A), op(C, "zero_", writes=[D(512, 1 * KB)])]
    one(evs, ALLOC_REUSE, (A, "fill_"), (C, "zero_"), BASE + 512, BASE + 1 * KB)


@pytest.mark.parametrize("sync", ["stream_sync", "device_sync", "op_blocking"])
def test_alloc_reuse_old_access_host_synced_no_finding(sync):
    evs = streams(A, B, C) + [alloc(0, BASE, 1 * KB, A),
                              op(A, "fill_", writes=[D(0, 1 * KB)],
                                 flags=OP_BLOCKING if sync == "op_blocking" else 0)]
    evs += {"stream_sync": [stream_sync(A)], "device_sync": [device_sync(0)], "op_blocking": []}[sync]
    none(evs + [free(0, BASE), alloc(0, BASE, 1 * KB, A), op(C, "zero_", writes=[D(0, 1 * KB)])])


def test_alloc_reuse_new_user_waits_for_owner_no_finding():
    none(reuse_prefix() + [event_record(1, A), event_wait(1, C), op(C, "zero_", writes=[D(0, 1 * KB)])])


def test_alloc_reuse_owner_itself_no_finding():
    none(reuse_prefix() + [op(A, "zero_", writes=[D(0, 1 * KB)])])


def test_recorded_user_old_access_is_not_reported():
    # B wrote the old life and was recorded: the allocator's deferred reuse orders B's access before the new
    # life, even for a stream (C) that never waited for B.
    evs = streams(A, B, C) + [alloc(0, BASE, 1 * KB, A), op(B, "copy_", writes=[D(0, 1 * KB)]),
                              record_stream(0, BASE, B), free(0, BASE), alloc(0, BASE, 1 * KB, A),
                              op(C, "zero_", writes=[D(0, 1 * KB)])]
    none(evs)


def test_recorded_user_and_owner_old_accesses():
    # The deferred reuse edge covers the recorded user B, not the owner A: C still races with A's old write.
    evs = streams(A, B, C) + [alloc(0, BASE, 1 * KB, A), op(A, "fill_", writes=[D(0, 512)]),
                              op(B, "copy_", writes=[D(512, 512)]), record_stream(0, BASE, B), free(0, BASE),
                              alloc(0, BASE, 1 * KB, A), op(C, "zero_", writes=[D(0, 1 * KB)])]
    one(evs, ALLOC_REUSE, (A, "fill_"), (C, "zero_"), BASE, BASE + 512)


def test_history_survives_free_without_reallocation_on_the_same_stream():
    # P freed by A and handed to an allocation on C from another library's pool (its own free lists, no release
    # to the driver implied): C's write still sees A's unordered old write.
    evs = streams(A, C) + [alloc(0, BASE, 1 * KB, A), op(A, "fill_", writes=[D(0, 1 * KB)]), free(0, BASE),
                           alloc(0, BASE, 1 * KB, C, pool=E.FOREIGN_POOL), op(C, "zero_", writes=[D(0, 1 * KB)])]
    one(evs, ALLOC_REUSE, (A, "fill_"), (C, "zero_"), BASE, BASE + 1 * KB)


def test_pinned_memory_reuse_after_stream_copies_not_reported():
    # old life: A's D2H fills the buffer, B (after waiting for A) copies half of it back; nobody synchronizes
    evs = pinned2() + [op(A, "copy_d2h", writes=[P(0, 1 * KB)]), event_record(1, A), event_wait(1, B),
                       op(B, "copy_h2d", reads=[P(0, 512)]), free(PINNED, PIN), alloc(PINNED, PIN, 1 * KB, HOST),
                       host_access("cpu_fill", writes=[P(0, 1 * KB)]), op(B, "copy_h2d", reads=[P(0, 1 * KB)])]
    none(evs)


def test_pinned_memory_without_reuse_is_reported():
    # the same accesses without the free/reallocation: the host write races with A's copy
    evs = pinned2() + [op(A, "copy_d2h", writes=[P(0, 1 * KB)]), host_access("cpu_fill", writes=[P(0, 1 * KB)])]
    one(evs, HOST_DEVICE, (A, "copy_d2h"), (HOST, "cpu_fill"), PIN, PIN + 1 * KB, space=PINNED)


# ============================================================================ memory handed back to the driver


def test_release_ends_the_pending_missing_record_stream():
    # mrs_prefix: B's read of P unrecorded. P goes back to the driver (empty_cache's cudaFree, which waits for the
    # whole device) before A allocates again: nothing is in flight any more, and A's new life over P's bytes is
    # ordered after B's read.
    again = [alloc(0, BASE, 1 * KB, A), op(A, "copy_h2d", writes=[D(0, 1 * KB)])]
    one(mrs_prefix() + again, MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    none(mrs_prefix() + [E.release(0, BASE, 2 * KB)] + again)


def test_release_of_other_memory_keeps_the_race():
    # the block lies in a segment that stays (split, another block of it still live): empty_cache releases other
    # segments only, and the missing record_stream stays a finding
    again = [alloc(0, BASE, 1 * KB, A), op(A, "copy_h2d", writes=[D(0, 1 * KB)])]
    a, f = one(mrs_prefix() + [E.release(0, BASE + 2 * KB, 2 * KB)] + again,
               MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    assert f.reused is True


def test_release_orders_every_stream_before_the_next_life():
    # A writes P; P is freed and released; B gets the same bytes from a new segment and reads them: ordered
    evs = streams(A, B) + [alloc(0, BASE, KB, A), op(A, "fill_", writes=[D(0, KB)]), free(0, BASE),
                           E.release(0, BASE, KB), alloc(0, BASE, KB, B), op(B, "sum", reads=[D(0, KB)])]
    none(evs)
    # a release orders only its own bytes: the same write of a neighbour is still a race
    evs = streams(A, B) + [alloc(0, BASE, 2 * KB, A), op(A, "fill_", writes=[D(0, 2 * KB)]), free(0, BASE),
                           E.release(0, BASE, KB), alloc(0, BASE, 2 * KB, A), op(B, "sum", reads=[D(0, 2 * KB)])]
    one(evs, ALLOC_REUSE, (A, "fill_"), (B, "sum"), BASE + KB, BASE + 2 * KB)


@pytest.mark.parametrize("owner, pool", [(B, 0), (A, 3)], ids=["another stream", "another pool"])
def test_a_block_that_changes_stream_or_pool_went_through_the_driver(owner, pool):
    # the caching allocator hands a freed block only to its own stream and pool; the same bytes allocated on
    # another stream or from another pool were released (the free-and-retry before an out-of-memory error, a
    # graph's pool, a memory pool's end) and obtained again: A's write and B's unrecorded read are done
    evs = streams(A, B) + [alloc(0, BASE, KB, A), op(A, "fill_", writes=[D(0, KB)]), event_record(1, A),
                           event_wait(1, B), op(B, "cat", reads=[D(0, KB)]), free(0, BASE), alloc(0, BASE, KB, owner, pool=pool), op(owner, "zero_", writes=[D(0, KB)])]
    none(evs + [alloc(0, BASE + 4 * KB, 64, A)])  # (A's next allocation: B's read is not pending any more)
    # a free the tracer did not see: the same, with its note
    a = none([e for e in evs if e[0] != E.FREE])
    assert ("warning", "an allocation overlapped live memory (a free was not seen)") in a.notes


def test_release_over_a_block_still_live_ends_it():
    evs = streams(A, B) + [alloc(0, BASE, KB, A), op(A, "fill_", writes=[D(0, KB)]), E.release(0, BASE, KB),
                           alloc(0, BASE, KB, A), op(B, "zero_", writes=[D(0, KB)])]
    a = none(evs)
    assert a.notes == []


def test_release_is_a_valid_event():
    assert E.validate([E.RELEASE, 0, BASE, KB, 0]) == E.release(0, BASE, KB)
    with pytest.raises(E.BadEvent):
        E.validate([E.RELEASE, 0, BASE, KB])


# ============================================================================ folding


def test_missing_record_stream_folds_the_reuse_race():
    # P on A read by B (no record_stream), freed; the next allocation on A takes P's bytes and A writes them
    # without waiting for B: one missing-record-stream finding (reused), no separate alloc-reuse finding.
    a, f = one(mrs_prefix() + [alloc(0, BASE, 1 * KB, A), op(A, "copy_h2d_next", writes=[D(0, 1 * KB)])],
               MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    assert f.reused is True
    kinds = [(o.kind, o.folded) for o in a.occurrences]
    assert kinds == [(MISSING_RECORD_STREAM, False), (ALLOC_REUSE, True)]
    assert a.occurrences[1].prev_seq == f.previous.seq
    assert a.occurrences[1].cur_seq == len(mrs_prefix()) + 1


def test_missing_record_stream_fold_marks_later_reuse():
    # The allocation that triggers the finding lies elsewhere (reused False); a later allocation on C takes P's
    # bytes and C's write races with B's old read: folded into the finding, which now says reused.
    evs = mrs_prefix() + [alloc(0, BASE + Q_OFF, 64, A)]
    a = run(evs)
    (f,) = a.sorted_findings()
    assert f.kind == MISSING_RECORD_STREAM and f.reused is False
    # C waits for A (so A's old copy_h2d is ordered before it), not for B
    a.feed([alloc(0, BASE, 1 * KB, C, pool=E.FOREIGN_POOL), event_record(3, A), event_wait(3, C),
            op(C, "zero_", writes=[D(0, 1 * KB)])])
    fs = a.sorted_findings()
    assert fs == [f]
    check(f, MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    assert f.reused is True
    assert [(o.kind, o.folded) for o in a.occurrences][-1:] == [(ALLOC_REUSE, True)]


def test_fold_applies_when_the_reuse_precedes_the_report():
    # P on A written by B (no record_stream), freed; P's bytes go to an allocation on C (from another library's
    # pool: a reporting caching allocator would have handed them over only through the driver); then A's next
    # allocation (elsewhere) reports X = B's copy_; then C reads P without waiting for B. semantics.md: "Races
    # of a reported X with accesses of any later life of b's bytes are folded into this finding".
    evs = streams(A, B, C) + [alloc(0, BASE, KB, A), op(B, "copy_", writes=[D(0, KB)]), free(0, BASE),
                              alloc(0, BASE, KB, C, pool=E.FOREIGN_POOL), alloc(0, BASE + Q_OFF, 64, A),
                              op(C, "sum", reads=[D(0, KB)])]
    a, f = one(evs, MISSING_RECORD_STREAM, (B, "copy_"), (A, "allocation"), BASE, BASE + KB)
    assert [(o.kind, o.folded) for o in a.occurrences] == [(MISSING_RECORD_STREAM, False), (ALLOC_REUSE, True)]


def test_fold_is_per_block():
    # B reads P (A's block) and Q (A's block from pool 7) in one op; both freed. A's next allocation from its own
    # free lists reports the missing record_stream of P only. C then gets both P's and Q's bytes (from another
    # library's pool) and writes them:
    # the race on P's bytes is folded into that finding; the same read's race on Q's bytes is a finding of its
    # own (Q's missing record_stream is never reported: A never allocates from pool 7 again).
    q = 4 * KB
    evs = streams(A, B, C) + [alloc(0, BASE, KB, A), alloc(0, BASE + q, KB, A, pool=7),
                              op(B, "cat", reads=[D(0, KB), D(q, KB)]), free(0, BASE), free(0, BASE + q),
                              alloc(0, BASE + Q_OFF, 64, A),
                              alloc(0, BASE, KB, C, pool=E.FOREIGN_POOL), alloc(0, BASE + q, KB, C, pool=E.FOREIGN_POOL),
                              op(C, "zero_", writes=[D(0, KB)]), op(C, "zero_", writes=[D(q, KB)])]
    a = run(evs)
    fs = a.sorted_findings()
    assert len(fs) == 2, fs
    check(fs[0], MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + KB)
    check(fs[1], ALLOC_REUSE, (B, "cat"), (C, "zero_"), BASE + q, BASE + q + KB)
    assert [(o.kind, o.lo, o.folded) for o in a.occurrences if o.kind == ALLOC_REUSE] == [
        (ALLOC_REUSE, BASE, True), (ALLOC_REUSE, BASE + q, False)]


def test_unfolded_old_access_still_reported_as_alloc_reuse():
    # C's write also races with A's old copy_h2d (not part of any missing-record-stream finding): alloc-reuse.
    evs = mrs_prefix() + [alloc(0, BASE, 1 * KB, A), op(C, "zero_", writes=[D(0, 1 * KB)])]
    a = run(evs)
    fs = a.sorted_findings()
    assert len(fs) == 2, fs
    check(fs[0], ALLOC_REUSE, (A, "copy_h2d"), (C, "zero_"), BASE, BASE + 1 * KB)
    check(fs[1], MISSING_RECORD_STREAM, (B, "cat"), (A, "allocation"), BASE, BASE + 1 * KB)
    assert fs[1].reused is True


# ============================================================================ dedup and fingerprints
STACKS = [
    def_stack(1, [["/usr/lib/python3.11/site-packages/torch/_tensor.py", 500, "__torch_function__"],
                  ["/home/alice/proj/model/train.py", 10, "produce"]]),
    def_stack(2, [["/home/alice/proj/model/train.py", 20, "consume"]]),
    def_stack(3, [["/home/alice/proj/model/train.py", 30, "consume_again"]]),
]


def loop(iters, consumer_stack=lambda i: 2):
    evs = streams(A, B) + STACKS + [alloc(0, BASE, 1 * KB, A)]
    for i in range(iters):
        evs += [op(A, "fill_", writes=[D(0, 1 * KB)], stack=1),
                op(B, "sum", reads=[D(0, 1 * KB)], stack=consumer_stack(i)),
                device_sync(0)]
    return evs


def test_dedup_same_locations_in_a_loop():
    a, f = one(loop(10), DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + 1 * KB, count=10)
    assert (f.prev_loc, f.cur_loc) == ("proj/model/train.py:10", "proj/model/train.py:20")
    assert f.fingerprint == fingerprint(DEVICE_DEVICE, "proj/model/train.py:10", "proj/model/train.py:20")
    assert len(a.occurrences) == 10
    # the finding keeps the first occurrence
    assert f.previous.seq == len(streams(A, B) + STACKS) + 1


def test_dedup_different_locations_are_different_findings():
    a = run(loop(10, consumer_stack=lambda i: 2 if i % 2 == 0 else 3))
    fs = a.sorted_findings()
    assert len(fs) == 2, fs
    check(fs[0], DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + 1 * KB, count=5)
    check(fs[1], DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + 1 * KB, count=5)
    assert [f.cur_loc for f in fs] == ["proj/model/train.py:20", "proj/model/train.py:30"]
    assert fs[0].fingerprint != fs[1].fingerprint


def test_dedup_different_kinds_are_different_findings():
    # same code locations, one device-device and one host-device pair (host accesses on stack 2 too)
    evs = streams(A, B) + STACKS + [alloc(0, BASE, 1 * KB, A), alloc(PINNED, PIN, 1 * KB, HOST),
                                    op(A, "fill_", writes=[D(0, 1 * KB), P(0, 1 * KB)], stack=1),
                                    op(B, "sum", reads=[D(0, 1 * KB)], stack=2),
                                    host_access("sum", reads=[P(0, 1 * KB)], stack=2)]
    fs = run(evs).sorted_findings()
    assert [f.kind for f in fs] == [DEVICE_DEVICE, HOST_DEVICE]
    assert fs[0].fingerprint != fs[1].fingerprint


def test_fingerprints_stable_between_runs_and_machines():
    evs = loop(3, consumer_stack=lambda i: 2 + i % 2)
    fp1 = sorted((f.fingerprint, f.count) for f in run(evs).findings.values())
    fp2 = sorted((f.fingerprint, f.count) for f in run(evs).findings.values())
    assert fp1 == fp2 and len(fp1) == 2
    # another machine: other stack ids, other path prefixes and library frames, other addresses and agent ids
    other = [
        def_stack(41, [["/opt/conda/lib/python3.12/site-packages/torch/nn/modules/module.py", 1, "_call_impl"],
                       ["/srv/bob/proj/model/train.py", 10, "produce"]]),
        def_stack(42, [["/srv/bob/proj/model/train.py", 20, "consume"]]),
        def_stack(43, [["/srv/bob/proj/model/train.py", 30, "consume_again"]]),
    ]
    evs2 = [stream(5, 0, 0xAAA0), stream(6, 0, 0xBBB0)] + other + [alloc(0, 0x1000, 64, 5)]
    for i in range(3):
        evs2 += [op(5, "fill_", writes=[rng(0, 0x1000, 64)], stack=41),
                 op(6, "sum", reads=[rng(0, 0x1000, 64)], stack=42 + i % 2), device_sync(0)]
    fp3 = sorted((f.fingerprint, f.count) for f in run(evs2).findings.values())
    assert fp3 == fp1


def test_location_falls_back_to_op_name_without_stack():
    _, f = one(base3() + [op(A, "fill_", writes=[D(0, 64)]), op(B, "sum", reads=[D(0, 64)])],
               DEVICE_DEVICE, (A, "fill_"), (B, "sum"), BASE, BASE + 64)
    assert (f.prev_loc, f.cur_loc) == ("op:fill_", "op:sum")
    assert f.fingerprint == fingerprint(DEVICE_DEVICE, "op:fill_", "op:sum")


@pytest.mark.parametrize("case", ["dense", "strided"])
def test_one_racing_pair_counts_once_however_the_shadow_is_fragmented(case):
    if case == "dense":
        # A writes 1 KiB; C (after A) reads the middle, which splits the shadow into 3 intervals holding A's
        # write; B then writes the whole 1 KiB without waiting for A: one racing pair of ops, one occurrence.
        evs = base3() + [op(A, "fill_", writes=[D(0, 1 * KB)]), event_record(1, A), event_wait(1, C),
                         op(C, "sum", reads=[D(256, 256)]), op(B, "zero_", writes=[D(0, 1 * KB)])]
    else:
        # A writes all of x; C (after A) writes x[:, :64], whose extent ends before x's end (2 intervals);
        # B reads x[:, 64:] without waiting for A: one racing pair (A's fill_, B's sum).
        evs = streams(A, B, C) + [alloc(0, BASE, N * ROW, A), op(A, "fill_", writes=[D(0, N * ROW)]),
                                  event_record(1, A), event_wait(1, C), op(C, "zero_", writes=[xview(0, 64)]),
                                  op(B, "sum", reads=[xview(64, 64)])]
    a = run(evs)
    fs = a.sorted_findings()
    assert len(fs) == 1
    assert fs[0].count == 1


def test_a_findings_memory_is_its_first_occurrence():
    """A loop's second occurrence touches more bytes, in fragments (its first bytes were written by the first
    occurrence's op): it is counted, and the finding keeps the first occurrence's range."""
    evs = base3() + [alloc(PINNED, PIN, 256, HOST),
                     op(A, "copy_", reads=[P(0, 20)], stack=1), op(HOST, "refill", writes=[P(4, 16)], stack=2),
                     op(A, "copy_", reads=[P(0, 24)], stack=1), op(HOST, "refill", writes=[P(4, 20)], stack=2)]
    one(evs, HOST_DEVICE, (A, "copy_"), (HOST, "refill"), PIN + 4, PIN + 20, space=PINNED, count=2)


# ============================================================================ retirement


def test_retire_empties_shadow_of_synced_freed_memory():
    a = run(mrs_prefix() + [alloc(0, BASE + Q_OFF, 64, C), op(C, "fill_", writes=[D(Q_OFF, 64)]),
                            free(0, BASE + Q_OFF), device_sync(0)])
    assert a.sorted_findings() == []
    assert a.shadow_size() > 0
    a.retire()
    assert a.shadow_size() == 0
    # A's next allocation: B's read was synchronized, nothing is pending
    a.feed([alloc(0, BASE, 1 * KB, A), op(B, "zero_", writes=[D(0, 1 * KB)])])
    assert a.sorted_findings() == []


def test_retire_keeps_live_blocks_and_unsynced_accesses():
    evs = streams(A, B, C) + [alloc(0, BASE, 1 * KB, A), alloc(0, BASE + Q_OFF, 1 * KB, B),
                              op(A, "fill_", writes=[D(0, 1 * KB)]), stream_sync(A),
                              op(B, "fill_", writes=[D(Q_OFF, 1 * KB)])]
    a = run(evs)
    a.retire()
    assert a.shadow_size() == 2  # two live blocks; A's synced write forgotten, B's kept
    a.feed([op(C, "sum", reads=[D(0, 1 * KB)]), op(C, "sum_b", reads=[D(Q_OFF, 1 * KB)])])
    (f,) = a.sorted_findings()
    check(f, DEVICE_DEVICE, (B, "fill_"), (C, "sum_b"), BASE + Q_OFF, BASE + Q_OFF + KB)


def test_retired_synced_access_not_reported_later():
    # automatic retirement after every sync; the pinned buffer's synced D2H is never reported, the unsynced
    # one is
    evs = pinned2() + [op(A, "copy_d2h", writes=[P(0, 512)]), stream_sync(A),
                       op(B, "copy_d2h_b", writes=[P(512, 512)]), event_record(1, A), event_sync(1),
                       host_access("cpu_read", reads=[P(0, 1 * KB)])]
    for every in (1, 1 << 16):
        one(evs, HOST_DEVICE, (B, "copy_d2h_b"), (HOST, "cpu_read"), PIN + 512, PIN + KB, space=PINNED,
            retire_every=every)


def test_retirement_bounds_shadow_in_a_long_loop():
    evs = streams(A, B) + [alloc(PINNED, PIN, 4 * KB, HOST)]
    a = Analyzer(keep_occurrences=True, retire_every=16)
    a.feed(evs)
    for i in range(200):
        off = (i % 4) * KB
        a.feed([alloc(0, BASE + i * 4 * KB, 4 * KB, A), op(A, "fill_", writes=[D(i * 4 * KB, 4 * KB)]),
                op(A, "copy_d2h", reads=[D(i * 4 * KB, 4 * KB)], writes=[P(off, KB)]),
                free(0, BASE + i * 4 * KB), stream_sync(A), host_access("cpu_read", reads=[P(off, KB)])])
    assert a.sorted_findings() == []
    a.retire()
    # only the live pinned buffer is left (one interval per 1 KiB slice it was accessed by); every freed and
    # synchronized device block is gone
    assert a.shadow_size() <= 4
    assert len(a.shadow[0]) == 0


# ============================================================================ no torch / cupy in the core


def test_core_imports_no_torch_or_cupy(tmp_path):
    # poison modules first on the path: importing them fails loudly; sys.modules must not hold them either
    for name in ("torch", "cupy"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('streamsan core imported {name}')\n")
    code = textwrap.dedent("""
        import sys
        import streamsan.events, streamsan.analysis.shadow, streamsan.analysis.allocator, streamsan.analysis.findings
        import streamsan.analysis.layout, streamsan.trace, streamsan.analysis.analyzer
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cupy", "cupyx"))
        print("BAD", bad)
        assert not bad, bad
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    p = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "BAD []" in p.stdout
