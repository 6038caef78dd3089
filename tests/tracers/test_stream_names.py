"""Streams named after what their creating line assigns them to (``streamsan.tracers.naming``), and the
registry's naming of streams made on one line."""

import sys

import pytest

from streamsan import events as E
from streamsan.agents import StreamRegistry
from streamsan.sink import EventBuffer
from streamsan.tracers.naming import assigned_to, creation_name


@pytest.mark.parametrize("line, name", [
    ("        self.copy_stream = torch.cuda.Stream()\n", "self.copy_stream"),
    ("s = torch.cuda.Stream(priority=-1)", "s"),
    ("    self.streams[dev] = torch.cuda.Stream(device=dev)", "self.streams[dev]"),
    ("    stream: torch.cuda.Stream = torch.cuda.Stream()", "stream"),
    ("streams = [torch.cuda.Stream() for _ in range(4)]", "streams"),
    ("with torch.cuda.stream(torch.cuda.Stream()):", None),
    ("return torch.cuda.Stream()", None),
    ("a, b = torch.cuda.Stream(), torch.cuda.Stream()", None),
    ("x += 1", None),
    ("if s == torch.cuda.Stream():", None),
    ("", None),
])
def test_the_assignment_target_of_a_line(line, name):
    assert assigned_to(line) == name


def test_streams_made_in_one_unpacking_are_named_by_their_places():
    """``a, b = Stream(), Stream()``: each stream gets the target in its place (before, both had no name)."""
    def make():
        return creation_name(sys._getframe(1))

    compute_stream, comm_stream = make(), make()
    assert (compute_stream, comm_stream) == ("compute_stream", "comm_stream")

    class Engine:
        def __init__(self):
            self.h2d, self.pool[0] = make(), make()

        pool = {}

    e = Engine()
    assert (e.h2d, e.pool[0]) == ("self.h2d", "self.pool[0]")
    a, n = make(), len("n")
    assert (a, n) == ("a", 1)
    first, second = (make(), make()) if True else (None, None)  # (one expression: no element of its own)
    assert (first, second) == (None, None)


def test_a_stream_made_on_a_continuation_line_is_named_by_its_assignment():
    """torchrec: ``self._memcpy_stream = (`` on one line, the stream made on the next, inside the brackets."""
    from streamsan.tracers.naming import continued_from

    lines = ["    def __init__(self, device):\n",
             "        self._memcpy_stream = (\n",
             "            torch.cuda.Stream(priority=-1) if device.type == 'cuda' else None\n",
             "        )\n",
             "        run(\n",
             "            torch.cuda.Stream())\n",
             "        x = 1\n",
             "        y = torch.cuda.Stream()\n"]
    assert continued_from(lines, 3) == "self._memcpy_stream"
    assert continued_from(lines, 6) is None  # (passed straight to a call)
    assert continued_from(lines, 8) is None  # (the assignment before it is closed)

    def make():
        return creation_name(sys._getframe(1))

    self_stream = (
        make() if True else None
    )
    assert self_stream == "self_stream"


def test_the_name_comes_from_the_first_frame_outside_streamsan():
    def make():  # stands for a wrapper inside streamsan: the frame it is given is the creating line's
        return creation_name(sys._getframe(1))

    side_stream = make()
    assert side_stream == "side_stream"


def test_streams_made_on_one_line_are_told_apart():
    buf = EventBuffer()
    reg = StreamRegistry(buf)
    for handle in (0x10, 0x20, 0x10):  # the third: a stream of the pool handed out again
        reg.name_created(0, handle, "self.streams")
    reg.name_created(0, 0x30, "other")
    names = [(ev[3], ev[5]) for ev in buf.events if ev[0] == E.STREAM and ev[5]]
    assert names == [(0x10, "self.streams"), (0x20, "self.streams#2"), (0x10, "self.streams"), (0x30, "other")]


def test_a_role_name_goes_only_to_streams_without_a_name():
    """A CUDA graph's capture stream is named by its role unless the program named it (or it is a default stream,
    named so), and a new stream that gets a forgotten stream's handle has no name yet."""
    buf = EventBuffer()
    reg = StreamRegistry(buf)
    reg.name_created(0, 0x10, "self.capture")
    for handle in (0x10, 0x20, 0):
        reg.name_unnamed(0, handle, "graph capture stream")
    reg.forget(0, 0x20)
    reg.name_unnamed(0, 0x20, "graph capture stream")
    names = [(ev[3], ev[5]) for ev in buf.events if ev[0] == E.STREAM and ev[5]]
    assert names == [(0x10, "self.capture"), (0x20, "graph capture stream"), (0, "default"),
                     (0x20, "graph capture stream")]


def test_a_name_given_later_wins_in_the_report():
    from streamsan.analysis.analyzer import Analyzer

    buf = EventBuffer()
    reg = StreamRegistry(buf)
    reg.name_created(0, 0x10, "self.copy_stream")
    reg.name(0, 0x10, "prefetch_stream")
    a = Analyzer()
    a.feed(buf.events)
    assert [i.name for i in a.agents.values()] == ["host", "prefetch_stream"]


def test_the_torch_tracer_patches_stream_creation_only_while_it_runs():
    torch = pytest.importorskip("torch")
    from streamsan.tracers.torch.tracer import TorchTracer

    before = torch.cuda.Stream.__dict__["__new__"]
    tracer = TorchTracer(EventBuffer())
    tracer.start()
    try:
        assert torch.cuda.Stream.__new__.__wrapped__ is before.__func__
    finally:
        tracer.stop()
    assert torch.cuda.Stream.__dict__["__new__"] is before


def test_a_stream_made_from_native_code_gets_no_name_and_no_error():
    """A patched constructor called with no Python frame above it (a stream made by native code): no name, and
    nothing raised into the program (before, looking one frame up raised ValueError there)."""
    import _thread
    import collections
    import itertools

    from streamsan.tracers.naming import caller_name

    results = []
    done = _thread.allocate_lock()
    done.acquire()
    # caller_name called from C, in a thread whose only Python frame is its own; then the lock released from C
    steps = itertools.chain(itertools.starmap(results.extend, [(map(caller_name, [2]),)]),
                            itertools.starmap(done.release, [()]))
    _thread.start_new_thread(collections.deque, (steps, 0))
    assert done.acquire(timeout=10)
    assert results == [None]

    def constructor():  # a patched constructor: the name of what its caller's line assigns
        return caller_name()

    made_here = constructor()
    assert made_here == "made_here"


def test_no_name_where_the_source_is_not_there():
    """A program read from standard input has no lines in linecache; an edited file may have fewer than the frame's
    line: no name, never an error."""
    from streamsan.tracers.naming import continued_from

    assert continued_from([], 5) is None
    assert continued_from(["s = (\n", "    torch.cuda.Stream()\n"], 9) is None
    assert continued_from(["s = (\n", "    torch.cuda.Stream()\n"], 2) == "s"
