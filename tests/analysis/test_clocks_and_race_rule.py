"""streamsan.analysis.clocks (vector clocks and the synchronization that moves them) and
streamsan.analysis.race.unordered (the happens-before test of two accesses), with exact results."""

from __future__ import annotations


import pytest


from streamsan.analysis.clocks import Clocks, join, knows
from streamsan.analysis.race import ShadowChecker, unordered
from streamsan.analysis.shadow import Access
from streamsan.events import BLOCKING, HOST, LEGACY_DEFAULT, MAX_AGENT


def access(agent, clock, seq=0, writes=()):
    return Access(agent, clock, seq, "op", 0, 0, (), writes)


# ------------------------------------------------------------------ join and knows


def test_join_takes_the_componentwise_maximum():
    dst = [3, 0, 5]
    join(dst, [1, 4, 5])
    assert dst == [3, 4, 5]


def test_join_of_a_shorter_clock_leaves_the_rest():
    dst = [0, 2, 7]
    join(dst, [1, 1])
    assert dst == [1, 2, 7]


def test_knows_compares_the_access_epoch_with_its_agents_component():
    clock = [4, 2, 0]
    assert knows(clock, access(1, 2)) is True
    assert knows(clock, access(1, 3)) is False
    assert knows(clock, access(2, 1)) is False
    assert knows(clock, access(0, 4)) is True


# ------------------------------------------------------------------ unordered


def test_unordered_accesses_of_one_agent_are_ordered_by_program_order():
    assert unordered(access(1, 9), 1, [1, 0]) is False


def test_unordered_when_the_clock_has_not_seen_the_epoch():
    assert unordered(access(1, 3), 2, [1, 2, 1]) is True


def test_ordered_when_the_clock_has_seen_the_epoch():
    assert unordered(access(1, 2), 2, [1, 2, 1]) is False
    assert unordered(access(1, 1), 0, [5, 3, 0]) is False


def test_unordered_host_access_against_a_stream():
    assert unordered(access(HOST, 2), 1, [1, 1]) is True
    assert unordered(access(HOST, 1), 1, [1, 1]) is False


# ------------------------------------------------------------------ Clocks


def test_a_new_analysis_knows_only_the_host():
    c = Clocks()
    assert c.vc == [[1]]
    assert list(c.agents) == [HOST]
    assert (c.host_gen, c.joined_gen, c.host_published, c.implicit) == (1, [0], False, [[]])


def test_declare_grows_every_clock_and_starts_the_streams_own_epoch():
    c = Clocks()
    c.declare(2, 0, 0xabc, 0, "side")
    assert c.vc == [[1, 0, 0], [0, 0, 0], [0, 0, 1]]
    assert c.joined_gen == [0, 0, 0]
    assert (c.agents[2].device, c.agents[2].handle, c.agents[2].name) == (0, 0xabc, "side")


def test_redeclaring_keeps_the_clock_and_a_name_given_before():
    c = Clocks()
    c.declare(1, 0, 5, 0, "main")
    c.vc[1][1] = 4
    c.declare(1, 1, 6, 0, "")
    assert c.vc[1] == [0, 4]
    assert (c.agents[1].device, c.agents[1].handle, c.agents[1].name) == (1, 6, "main")


@pytest.mark.parametrize("agent", [-1, MAX_AGENT])
def test_declare_refuses_ids_outside_the_stream_range(agent):
    with pytest.raises(ValueError):
        Clocks().declare(agent, 0, 0, 0, "")


def test_enqueue_joins_the_host_clock_once_per_generation():
    c = Clocks()
    c.declare(1, 0, 0, 0, "")
    c.vc[HOST][HOST] = 3
    c.host_gen = 2
    t = c.enqueue(1)
    assert t is c.vc[1]
    assert t == [3, 1]
    assert (c.joined_gen[1], c.host_published) == (2, True)
    c.vc[HOST][HOST] = 7  # (the host learned nothing new: no join)
    assert c.enqueue(1) == [3, 1]


def test_enqueue_of_an_agent_beyond_every_declared_one_raises_index_error():
    c = Clocks()
    with pytest.raises(IndexError):
        c.enqueue(3)
    assert c.vc == [[1]]


def test_the_host_ticks_before_its_access_only_after_publishing_its_epoch():
    c = Clocks()
    c.declare(1, 0, 0, 0, "")
    assert c.host_access() == [1, 0]
    c.enqueue(1)
    assert c.host_access() == [2, 0]
    assert (c.host_gen, c.host_published) == (2, False)
    assert c.host_access() == [2, 0]


def test_event_record_snapshots_the_stream_and_ticks_it():
    c = Clocks()
    c.declare(1, 0, 0, 0, "")
    c.event_record(7, 1)
    assert c.events[7] == [1, 1]
    assert c.vc[1] == [1, 2]


def test_event_wait_joins_the_snapshot_and_ignores_an_event_never_recorded():
    c = Clocks()
    c.declare(1, 0, 0, 0, "")
    c.declare(2, 0, 0, 0, "")
    c.event_record(7, 1)
    c.event_wait(7, 2)
    assert c.vc[2] == [1, 1, 1]
    c.event_wait(8, 2)
    assert c.vc[2] == [1, 1, 1]
    c.event_delete(7)
    assert 7 not in c.events


def test_host_waits_for_a_stream_learns_its_clock_and_ticks_it():
    c = Clocks()
    c.declare(1, 0, 0, 0, "")
    c.vc[1][1] = 5
    c.host_waits_for(1)
    assert c.vc[HOST] == [1, 5]
    assert c.vc[1] == [0, 6]
    assert c.host_gen == 2


def test_event_sync_learns_the_snapshot_and_says_whether_there_was_one():
    c = Clocks()
    c.declare(1, 0, 0, 0, "")
    c.event_record(3, 1)
    assert c.event_sync(4) is False
    assert c.host_gen == 1
    assert c.event_sync(3) is True
    assert c.vc[HOST] == [1, 1]
    assert c.host_gen == 2


def test_device_sync_learns_every_stream_of_the_device_only():
    c = Clocks()
    c.declare(1, 0, 0, 0, "")
    c.declare(2, 1, 0, 0, "")
    c.vc[1][1], c.vc[2][2] = 4, 6
    c.device_sync(0)
    assert c.vc[HOST] == [1, 4, 0]
    assert (c.vc[1][1], c.vc[2][2]) == (5, 6)


def test_legacy_default_stream_edges_with_blocking_streams_of_its_device():
    c = Clocks()
    c.declare(1, 0, 0, LEGACY_DEFAULT, "legacy")
    c.declare(2, 0, 0, BLOCKING, "blocking")
    c.declare(3, 0, 0, 0, "non-blocking")
    c.declare(4, 1, 0, BLOCKING, "other device")
    assert c.implicit == [[], [2], [1], [], []]
    c.vc[2][2] = 3
    t = c.enqueue(1)
    assert t == [1, 1, 3, 0, 0]
    assert c.vc[2][2] == 4  # (the blocking stream's work so far is ordered before the legacy stream's)


# ------------------------------------------------------------------ the shadow checks decide with unordered


class RaceLog:
    def __init__(self):
        self.races = []

    def race(self, prev, prev_write, cur, cur_write, seg, space):
        self.races.append((prev.agent, prev_write, cur.agent, cur_write, seg.start, seg.end, space))


def test_shadow_checks_report_exactly_the_unordered_pairs():
    c = Clocks()
    c.declare(1, 0, 0, 0, "")
    c.declare(2, 0, 0, 0, "")
    log = RaceLog()
    checker = ShadowChecker({}, c, log)
    w = (0, 100, 16)
    t1 = c.enqueue(1)
    checker.write(w, access(1, t1[1], 0, (w,)), t1)
    t2 = c.enqueue(2)
    checker.read((0, 104, 4), access(2, t2[2], 1), t2)  # unordered with stream 1's write
    c.event_record(9, 1)
    c.event_wait(9, 2)
    t2 = c.vc[2]
    checker.read((0, 100, 4), access(2, t2[2], 2), t2)  # ordered after it by the event
    assert log.races == [(1, True, 2, False, 104, 108, 0)]
