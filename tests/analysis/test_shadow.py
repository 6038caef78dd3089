"""streamsan.analysis.shadow: the byte-interval map (ShadowSpace) and access records (Access)."""

from __future__ import annotations


from hypothesis import given, settings
from hypothesis import strategies as st


from streamsan.analysis.shadow import Access, ShadowRange, ShadowSpace


def spans(sh):
    return [(r.start, r.end) for r in sh]


def check_invariants(sh):
    assert sh.starts == sorted(sh.starts)
    assert len(set(sh.starts)) == len(sh.starts)
    assert set(sh.ranges) == set(sh.starts)
    prev_end = None
    for s in sh.starts:
        r = sh.ranges[s]
        assert r.start == s and r.end > r.start
        if prev_end is not None:
            assert r.start >= prev_end
        prev_end = r.end


def acc(agent=1, clock=1, seq=0, name="op", reads=(), writes=()):
    return Access(agent, clock, seq, name, 0, 0, reads, writes)


# ------------------------------------------------------------------ ShadowSpace.cover


def test_cover_on_empty_space_creates_one_interval_without_history():
    sh = ShadowSpace()
    (r,) = sh.cover(100, 200)
    assert (r.start, r.end, r.write, r.reads, r.block) == (100, 200, None, None, None)
    assert len(sh) == 1
    check_invariants(sh)


def test_cover_of_an_existing_interval_returns_it():
    sh = ShadowSpace()
    (r,) = sh.cover(100, 200)
    r.write = acc()
    assert sh.cover(100, 200) == [r]
    assert len(sh) == 1


def test_cover_splits_and_fills_gaps():
    sh = ShadowSpace()
    a = sh.cover(100, 200)[0]
    a.write = w1 = acc(1)
    a.block = "blk1"
    b = sh.cover(300, 400)[0]
    b.write = w2 = acc(2)
    out = sh.cover(150, 350)
    assert [(r.start, r.end) for r in out] == [(150, 200), (200, 300), (300, 350)]
    assert [r.write for r in out] == [w1, None, w2]
    assert [r.block for r in out] == ["blk1", None, None]
    assert spans(sh) == [(100, 150), (150, 200), (200, 300), (300, 350), (350, 400)]
    # the split halves keep the state of the interval they came from
    assert [r.write for r in sh] == [w1, w1, None, w2, w2]
    check_invariants(sh)


def test_cover_inside_one_interval_splits_it_in_three():
    sh = ShadowSpace()
    r = sh.cover(0, 100)[0]
    r.write = w = acc()
    (mid,) = sh.cover(40, 60)
    assert (mid.start, mid.end, mid.write) == (40, 60, w)
    assert spans(sh) == [(0, 40), (40, 60), (60, 100)]
    check_invariants(sh)


def test_cover_before_and_after_existing_intervals():
    sh = ShadowSpace()
    sh.cover(100, 200)
    assert [(r.start, r.end) for r in sh.cover(0, 150)] == [(0, 100), (100, 150)]
    assert [(r.start, r.end) for r in sh.cover(150, 300)] == [(150, 200), (200, 300)]
    assert spans(sh) == [(0, 100), (100, 150), (150, 200), (200, 300)]
    check_invariants(sh)


def test_split_copies_a_reads_dict():
    sh = ShadowSpace()
    r = sh.cover(0, 100)[0]
    r.reads = {1: acc(1), 2: acc(2)}
    left, right = sh.cover(0, 50)[0], sh.cover(50, 100)[0]
    assert left.reads == right.reads and left.reads is not right.reads
    right.reads[3] = acc(3)
    assert 3 not in left.reads


# ------------------------------------------------------------------ other queries


def test_overlapping_does_not_modify():
    sh = ShadowSpace()
    sh.cover(0, 10)
    sh.cover(20, 30)
    sh.cover(40, 50)
    before = spans(sh)
    assert [(r.start, r.end) for r in sh.overlapping(5, 45)] == [(0, 10), (20, 30), (40, 50)]
    assert [(r.start, r.end) for r in sh.overlapping(10, 20)] == []
    assert [(r.start, r.end) for r in sh.overlapping(29, 30)] == [(20, 30)]
    assert sh.overlapping(50, 60) == []
    assert spans(sh) == before


def test_find():
    sh = ShadowSpace()
    sh.cover(0, 10)
    sh.cover(20, 30)
    assert sh.find(0).start == 0 and sh.find(9).start == 0
    assert sh.find(10) is None
    assert sh.find(25).start == 20
    assert sh.find(30) is None and sh.find(-1) is None


def test_merge_and_remove():
    sh = ShadowSpace()
    sh.cover(0, 100)
    rs = sh.cover(0, 30) + sh.cover(30, 60) + sh.cover(60, 100)
    assert spans(sh) == [(0, 30), (30, 60), (60, 100)]
    first = sh.merge(rs)
    assert first is rs[0] and (first.start, first.end) == (0, 100)
    assert spans(sh) == [(0, 100)]
    check_invariants(sh)
    sh.cover(200, 300)
    sh.remove(first)
    assert spans(sh) == [(200, 300)]
    assert sh.find(50) is None
    check_invariants(sh)


def test_iteration_tolerates_removal():
    sh = ShadowSpace()
    for lo in range(0, 100, 10):
        sh.cover(lo, lo + 5)
    for r in sh:
        if r.start % 20 == 0:
            sh.remove(r)
    assert spans(sh) == [(10, 15), (30, 35), (50, 55), (70, 75), (90, 95)]
    check_invariants(sh)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 60)), min_size=1, max_size=25))
def test_cover_property(calls):
    """Random covers: each returns contiguous intervals exactly covering the request; the map stays sorted and
    disjoint and covers exactly the union of all requests; an interval's tag survives the splits."""
    sh = ShadowSpace()
    union = set()
    tag_of_byte = {}
    for i, (lo, n) in enumerate(calls):
        hi = lo + n
        out = sh.cover(lo, hi)
        assert out[0].start == lo and out[-1].end == hi
        for x, y in zip(out, out[1:]):
            assert x.end == y.start
        for r in out:  # everything a cover returned now carries tag i (like a write)
            r.write = i
        union.update(range(lo, hi))
        for b in range(lo, hi):
            tag_of_byte[b] = i
        check_invariants(sh)
    covered = set()
    for r in sh:
        covered.update(range(r.start, r.end))
        for b in range(r.start, r.end):
            assert tag_of_byte[b] == r.write
    assert covered == union


# ------------------------------------------------------------------ Access, ShadowRange


def test_split_keeps_block_and_previous_block():
    sp = ShadowSpace()
    (r,) = sp.cover(0, 100)
    r.block, r.prev_block = "new", "old"
    left, right = sp.cover(0, 40)[0], sp.cover(40, 100)[0]
    assert (left.block, left.prev_block, right.block, right.prev_block) == ("new", "old", "new", "old")


def test_access_ranges_on():
    a = acc(reads=((0, 0, 64), (0, 128, 64)), writes=((0, 64, 64, (4, (16,), (1,))),))
    assert a.ranges_on(0, 1000, False) == [(0, 0, 64), (0, 128, 64)]
    assert a.ranges_on(60, 130, False) == [(0, 0, 64), (0, 128, 64)]
    assert a.ranges_on(64, 128, False) == []
    assert a.ranges_on(64, 65, True) == [(0, 64, 64, (4, (16,), (1,)))]
    assert a.ranges_on(0, 64, True) == []


def test_shadow_range_accesses():
    w1, w2, r1, r2 = acc(1), acc(2), acc(3), acc(4)
    assert list(ShadowRange(0, 1).accesses()) == []
    assert list(ShadowRange(0, 1, w1, r1).accesses()) == [w1, r1]
    assert list(ShadowRange(0, 1, [w1, w2], {3: r1, 4: r2}).accesses()) == [w1, w2, r1, r2]
