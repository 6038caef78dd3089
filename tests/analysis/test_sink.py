"""The event buffer between tracers and consumers."""

import threading

from streamsan.sink import EventBuffer


def test_consumers_get_every_batch_in_order():
    got = []
    buf = EventBuffer([got.append, lambda evs: got.append(("second", len(evs)))])
    buf.events += [("a",), ("b",)]
    buf.flush()
    buf.flush()  # nothing pending: no batch
    buf.events.append(("c",))
    buf.flush()
    assert got == [[("a",), ("b",)], ("second", 2), [("c",)], ("second", 1)] and buf.total == 3


def test_a_flush_from_inside_a_consumer_returns_and_its_events_go_with_the_next_one():
    """A garbage collection inside a consumer can free a CUDA tensor, whose free callback flushes a full buffer:
    that flush must not wait for the one in progress (the same thread holds it)."""
    got = []
    buf = EventBuffer()

    def consume(evs):
        got.append(list(evs))
        if len(got) == 1:
            buf.events.append(("late",))
            buf.flush()

    buf.consumers.append(consume)
    buf.events.append(("early",))
    t = threading.Thread(target=buf.flush, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the nested flush waited for the outer one"
    assert got == [[("early",)]] and buf.events == [("late",)]
    buf.flush()
    assert got == [[("early",)], [("late",)]]


def test_another_thread_s_flush_waits_for_the_one_in_progress():
    order = []
    buf = EventBuffer()
    inside, release = threading.Event(), threading.Event()

    def consume(evs):
        order.append(evs[0][0])
        if evs[0][0] == "first":
            inside.set()
            release.wait(10)

    buf.consumers.append(consume)
    buf.events.append(("first",))
    t1 = threading.Thread(target=buf.flush)
    t1.start()
    inside.wait(10)
    buf.events.append(("second",))
    t2 = threading.Thread(target=buf.flush)
    t2.start()
    t2.join(0.2)
    assert t2.is_alive() and order == ["first"]  # waiting, not skipped
    release.set()
    t1.join(10)
    t2.join(10)
    assert order == ["first", "second"]
