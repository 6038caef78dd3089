"""Where the tracer puts the events fired inside an op (CPU: the events are built by hand, as PyTorch's GPU trace
callbacks deliver them on a GPU). Allocations precede the op; a cross-device copy's first barrier (the
destination stream's event, waited for by the copying stream) precedes it; everything else follows it."""

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch import device  # noqa: E402
from streamsan.tracers.torch.callbacks import on_alloc  # noqa: E402
from streamsan.tracers.torch.dispatch import dispatch, dispatch_host  # noqa: E402
from streamsan.tracers.torch.placement import commit, run_inside  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402

SRC, DST = 1, 2  # the current streams of the source and destination devices
DEV0, DEV1 = 0x7000_0000, 0x9000_0000


def place(inner):
    tracer = TorchTracer(EventBuffer())
    evs = [("before",)]
    evs += inner
    op = E.op(SRC, "aten::copy_", reads=[E.rng(0, DEV0, 64)], writes=[E.rng(1, DEV1, 64)])
    tracer.place(evs, 1, op, None)
    return [("OP",) if ev is op else ev for ev in evs[1:]]


def test_a_cross_device_copy_waits_for_the_destination_before_and_signals_it_after():
    dst_ready = [E.event_record(11, DST), E.event_wait(11, SRC)]
    src_ready = [E.event_record(12, SRC), E.event_wait(12, DST)]
    assert place(dst_ready + src_ready) == dst_ready + [("OP",)] + src_ready


def test_allocations_first_and_the_pinned_allocators_event_and_syncs_after():
    a = E.alloc(0, DEV0 + 4096, 0, SRC)
    rec = E.event_record(13, SRC)
    sync = E.stream_sync(SRC)
    assert place([a, rec, sync]) == [a, ("OP",), rec, sync]


def test_a_temporary_allocated_and_freed_inside_the_op_stays_before_it():
    """``bincount`` allocates a temporary, frees it, and its output gets the same block: the frees of blocks the op
    allocated keep their place among its allocations (before, every free went after the op, so the output was
    freed there and the allocations overlapped); a free of memory allocated before the op stays after it."""
    tmp = E.alloc(0, DEV0 + 4096, 0, SRC)
    free_tmp = E.free(0, DEV0 + 4096)
    out = E.alloc(0, DEV0 + 4096, 0, SRC)
    free_older = E.free(0, DEV0 + 8192)
    rec = E.event_record(13, SRC)
    assert place([tmp, free_tmp, out, free_older, rec]) == [tmp, free_tmp, out, ("OP",), free_older, rec]


def test_a_wait_after_the_ops_own_record_stays_after():
    rec = E.event_record(14, SRC)
    wait = E.event_wait(15, SRC)
    assert place([rec, wait]) == [("OP",), rec, wait]


def test_a_copy_whose_events_are_all_on_other_streams_keeps_them_after():
    other = [E.event_record(16, DST), E.event_wait(16, 3)]
    assert place(other) == [("OP",)] + other


NCCL = 7


def place_collective(inner):
    tracer = TorchTracer(EventBuffer())
    evs = [("before",)] + inner
    op = E.op(SRC, "c10d::allreduce_", writes=[E.rng(0, DEV0, 64)])
    tracer.place(evs, 1, op, None, collective=True)
    return [("OP", ev[1]) if ev[0] == E.OP else ev for ev in evs[1:]]


def test_the_stream_a_collective_runs_on_is_named_in_reports():
    tracer = TorchTracer(EventBuffer())
    src, nccl = tracer.agent(0, 0x1000), tracer.agent(0, 0x4000)
    handoff = [E.event_record(21, src), E.event_wait(21, nccl)]
    for first in (True, False):  # named once
        evs = [("before",)] + handoff
        tracer.place(evs, 1, E.op(src, "c10d::allreduce_"), None, collective=True)
        named = [ev for ev in evs if ev[0] == E.STREAM]
        assert named == ([(E.STREAM, nccl, 0, 0x4000, 0, "collective stream")] if first else [])


KEPT_ALIVE = (E.RECORD_STREAM, 0, DEV0, NCCL, 0)  # its tensor's block is kept from reuse until it has run


def test_a_collective_runs_on_the_stream_that_waited_for_the_current_one():
    handoff = [E.event_record(21, SRC), E.event_wait(21, NCCL)]
    end = [E.event_record(22, NCCL)]
    assert place_collective(handoff + end) == handoff + [("OP", NCCL), KEPT_ALIVE] + end


def test_a_synchronous_collective_also_makes_the_current_stream_wait_after_it():
    handoff = [E.event_record(21, SRC), E.event_wait(21, NCCL)]
    after = [E.event_record(22, NCCL), E.event_wait(22, SRC)]
    assert place_collective(handoff + after) == handoff + [("OP", NCCL), KEPT_ALIVE] + after


def analyze_collective_then(after):
    """An async all-reduce of a block allocated on SRC, as the tracer places it, then ``after``: the findings."""
    from streamsan.analysis.analyzer import Analyzer

    tracer = TorchTracer(EventBuffer())
    inner = [E.event_record(21, SRC), E.event_wait(21, NCCL), E.event_record(22, NCCL)]
    evs = [E.stream(SRC, 0, 0x1000, name="default"), E.stream(NCCL, 0, 0x4000),
           E.alloc(0, DEV0, 64, SRC), E.op(SRC, "aten::fill_.Scalar", writes=[E.rng(0, DEV0, 64)])] + inner
    tracer.place(evs, 4, E.op(SRC, "c10d::allreduce_", writes=[E.rng(0, DEV0, 64)]), None, collective=True)
    a = Analyzer()
    a.feed(evs + after)
    a.finish()
    return [(f.kind, f.previous.agent, f.previous.name, f.current.agent, f.current.name)
            for f in a.sorted_findings()]


def test_freeing_a_collectives_tensor_before_wait_is_safe_as_pytorch_keeps_it_alive():
    reuse = [E.free(0, DEV0), E.alloc(0, DEV0, 64, SRC), E.op(SRC, "aten::add_.Tensor", writes=[E.rng(0, DEV0, 64)])]
    assert analyze_collective_then(reuse) == []


def test_using_a_collectives_tensor_before_wait_still_races():
    use = [E.op(SRC, "aten::mul_.Tensor", writes=[E.rng(0, DEV0, 64)])]
    assert analyze_collective_then(use) == [("device-device", NCCL, "c10d::allreduce_", SRC, "aten::mul_.Tensor")]


def test_a_collective_without_a_hand_off_stays_on_the_current_stream():
    other = [E.event_record(23, 3), E.event_wait(23, NCCL)]
    assert place_collective(other) == [("OP", SRC)] + other


def test_an_op_whose_run_saw_another_threads_flush_is_not_lost():
    from streamsan.tracers.torch.rules import OpPlan

    got = []
    tracer = TorchTracer(EventBuffer([got.extend]))
    plan = OpPlan(torch.ops.aten.add.Tensor)
    pinned = E.rng(E.PINNED, 0x5000, 16)

    def op_run_while_another_thread_flushes(*args, **kwargs):
        tracer.buffer.events.append(("other thread",))
        tracer.buffer.flush()
        return torch.ones(1)

    dispatch_host(tracer, op_run_while_another_thread_flushes, plan, (), {}, [pinned], [])
    tracer.buffer.flush()
    assert [ev[:3] for ev in got if ev[0] != E.DEF_STACK] == [("other thread",), (E.OP, E.HOST, "aten::add.Tensor")]


def test_allocations_inside_an_op_belong_to_its_stream_only_in_its_own_thread():
    import threading

    tracer = TorchTracer(EventBuffer())
    own, others = [], []
    tracer.op_agent = (0, SRC, 0, 0, threading.get_ident(), own)
    on_alloc(tracer, 0x7000)
    assert [ev[:5] for ev in own] == [(E.ALLOC, 0, 0x7000, 0, SRC)]  # the op's own list, placed with it
    tracer.op_agent = (0, SRC, 0, 0, threading.get_ident() + 1, others)  # another thread's op
    tracer.in_scope = 0  # (with the tracer on, the allocation would go to this thread's current stream)
    on_alloc(tracer, 0x8000)
    assert others == [] and len(own) == 1


def _other_thread_reuses(tracer, flush=False) -> None:
    """Another thread's work, run to its end while an op of this thread runs (PyTorch releases the GIL inside
    ops): it frees a block, allocates it again and writes it (and flushes the buffer)."""
    import threading

    def work():
        tracer.emit((E.FREE, 0, 0x1000, 0))
        tracer.emit((E.ALLOC, 0, 0x1000, 64, 2, 0, 0, ""))
        tracer.emit((E.OP, 2, "aten::other", (), ((0, 0x1000, 64),), 0, 0, 0))
        if flush:
            tracer.buffer.flush()

    th = threading.Thread(target=work)
    th.start()
    th.join()


OTHER_THREAD = [(E.FREE, 0x1000), (E.ALLOC, 0x1000), (E.OP, "aten::other")]  # (its events, in its order)


def _in_order(events):
    return [(ev[0], ev[2]) for ev in events if ev[0] in (E.ALLOC, E.FREE, E.OP)]


@pytest.mark.parametrize("flush", [False, True], ids=["", "flushed"])
def test_an_ops_events_stay_together_whatever_another_thread_does_meanwhile(monkeypatch, flush):
    """An op's allocation and the op itself reach the buffer together and in order, even when another thread
    frees, allocates the same memory again and runs an op (and flushes the buffer) while the first op runs:
    before, everything in the buffer since the op began was taken as its own, and the other thread's allocation
    was moved before its free."""

    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x1000)
    got = []
    tracer = TorchTracer(EventBuffer([got.extend]))

    def op(*args):
        on_alloc(tracer, 0x2000)  # this op's own allocation
        _other_thread_reuses(tracer, flush)

    tracer.in_scope = 1
    out, a, evs, mark = run_inside(tracer, op, (), {}, 0, 0)
    tracer.place(evs, mark, (E.OP, a, "aten::mine", (), ((0, 0x2000, 64),), 0, 0, 0), None)
    commit(tracer, evs)
    tracer.buffer.flush()
    assert _in_order(got) == OTHER_THREAD + [(E.ALLOC, 0x2000), (E.OP, "aten::mine")]


def test_a_host_ops_events_stay_apart_from_another_threads(monkeypatch):
    """A host op (``pin_memory()`` of a loader thread) that runs while another thread works: the other thread's
    events keep their order and their place, before the host op. Before, a host op took everything in the buffer
    since it began as its own and moved the allocations first: a block's new life began before the accesses of
    its old one (a false host-device race, seen on an H200 in a prefetcher thread's program)."""

    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x1000)
    got = []
    tracer = TorchTracer(EventBuffer([got.extend]))
    tracer.in_scope = 1
    out, a, evs, mark = run_inside(tracer, lambda: _other_thread_reuses(tracer), (), {}, -1, 0)
    assert a == E.HOST
    tracer.place(evs, mark, (E.OP, a, "aten::_pin_memory", (), ((E.PINNED, 0x9000, 64),), 0, 0, 0), None,
                 pre=[(E.ALLOC, E.PINNED, 0x9000, 64, E.HOST, 0, 0, "")])
    commit(tracer, evs)
    tracer.buffer.flush()
    assert _in_order(got) == OTHER_THREAD + [(E.ALLOC, 0x9000), (E.OP, "aten::_pin_memory")]


def test_a_like_factorys_events_stay_apart_from_another_threads(monkeypatch):
    """``ones_like(x)`` of a CUDA tensor reads none of it (no access, so no device among its accesses): it runs on
    x's device, with its own events, whatever another thread does meanwhile. Before, it took the other thread's
    events as its own and moved their allocation before their free."""
    from tests.support.torch_kit import cuda_like

    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x1000)
    got = []
    tracer = TorchTracer(EventBuffer([got.extend]))
    func = torch.ops.aten.ones_like.default
    plan = tracer.plan(func)
    x, result = cuda_like(16), cuda_like(16)

    def call(*args, **kwargs):
        on_alloc(tracer, result.data_ptr())
        _other_thread_reuses(tracer)
        return result

    plan.call = call
    tracer.in_scope = 1
    assert dispatch(tracer, func, (x,), {}) is result
    tracer.buffer.flush()
    assert _in_order(got) == OTHER_THREAD + [(E.ALLOC, result.data_ptr()), (E.OP, "aten::ones_like")]
