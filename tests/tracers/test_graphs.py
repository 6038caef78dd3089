"""The graph bookkeeping the tracers share (streamsan.tracers.graphs): merged ranges, and accesses kept per graph
whether or not its type takes weak references."""

from streamsan.tracers.graphs import GraphAccesses, merge_ranges


class WeakGraph:
    pass


class SlotGraph:
    """Like an extension type without a weak-reference slot."""

    __slots__ = ()


def test_merge_ranges_merges_overlaps_only_and_keeps_strided_ranges():
    strided = (0, 0x100, 64, (4, (4, 4), (8, 1)))
    got = merge_ranges([(0, 0x100, 64), (0, 0x120, 64), (0, 0x160, 16), (1, 0x100, 8), (0, 0x100, 64), strided,
                        strided])
    # 0x100..0x160 overlap; 0x160 only touches their end (another allocation may start there): kept apart
    assert got == ((0, 0x100, 0x60), (0, 0x160, 16), (1, 0x100, 8), strided)


def test_accesses_are_kept_per_graph_with_or_without_weak_references():
    acc = GraphAccesses()
    weak, slots, other = WeakGraph(), SlotGraph(), SlotGraph()
    acc.put(weak, 0, [(0, 0x100, 8)], [])
    acc.put(slots, 1, [], [(1, 0x200, 8), (1, 0x200, 8)])
    assert acc.get(weak) == (0, ((0, 0x100, 8),), ())
    assert acc.get(slots) == (1, (), ((1, 0x200, 8),))
    assert acc.get(other) is None
    del weak
    assert len(acc._weak) == 0  # a graph that can be weakly referenced is not kept alive
