"""Real PyTorch programs on a GPU, each with the exact findings streamsan must report (or none).

Each scenario is a small program; EXPECTED maps it to (kind, previous stream role, previous op, current
stream role, current op) tuples. Side streams are named "side" / "side2" with streamsan.name_stream.
"""


import torch

import streamsan
from tests.gpu.support.scenario_kit import scenario_tests, streams
from tests.support.fixtures import expected

N = 1 << 16


# ---------------------------------------------------------------------------------------------- races
def write_default_then_side_write():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    with torch.cuda.stream(s):
        x.fill_(2.0)
    torch.cuda.synchronize()


def write_default_then_side_read():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    with torch.cuda.stream(s):
        y = x.sum()
    torch.cuda.synchronize()
    del y


def side_read_then_default_write():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x.sum()
    x.fill_(3.0)  # the default stream overwrites x while side may still read it
    torch.cuda.synchronize()
    del y


def host_reads_pinned_after_async_d2h():
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    p = x.to("cpu", non_blocking=True)
    p.sum()  # host reads p before the copy is known complete
    torch.cuda.synchronize()


def host_writes_pinned_during_h2d():
    p = torch.empty(N).pin_memory()
    p.fill_(1.0)
    x = p.to("cuda", non_blocking=True)
    p.fill_(2.0)  # the H2D copy may still be reading p
    torch.cuda.synchronize()
    del x


def missing_record_stream():
    (s,) = streams("side")
    with torch.cuda.stream(s):
        x = torch.empty(N, device="cuda")
        x.fill_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    y = x * 2  # used on the default stream
    del x  # freed without record_stream: side may hand the block out again
    with torch.cuda.stream(s):
        z = torch.empty(N, device="cuda")
        z.fill_(5.0)
    torch.cuda.synchronize()
    del y, z


def alloc_reuse_on_other_stream():
    (s,) = streams("side")
    n = (5 << 18) + 1024  # a size of its own in the allocator's large pool: z gets x's block
    torch.cuda.empty_cache()
    x = torch.empty(n, device="cuda")
    x.fill_(1.0)
    y = x * 2
    del x
    z = torch.empty(n, device="cuda")  # x's block
    with torch.cuda.stream(s):
        z.fill_(7.0)  # written on side without waiting for the default stream's old work on the block
    torch.cuda.synchronize()
    del y, z


def d2h_then_h2d_pinned_across_streams():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    p = x.to("cpu", non_blocking=True)  # D2H on default into fresh pinned memory
    with torch.cuda.stream(s):
        y = p.to("cuda", non_blocking=True)  # H2D on side reads p without waiting for default
    torch.cuda.synchronize()
    del y


def overlapping_views_two_streams():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x[: N // 2 + 8].fill_(1.0)
    with torch.cuda.stream(s):
        x[N // 2:].fill_(2.0)
    torch.cuda.synchronize()


def wait_on_unrecorded_event():
    (s,) = streams("side")
    e = torch.cuda.Event()
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    s.wait_event(e)  # never recorded: no ordering
    with torch.cuda.stream(s):
        x.fill_(2.0)
    torch.cuda.synchronize()


def wait_wrong_direction():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    torch.cuda.current_stream().wait_stream(s)  # the wrong way round
    with torch.cuda.stream(s):
        x.fill_(2.0)
    torch.cuda.synchronize()


def strided_columns_overlap():
    (s,) = streams("side")
    x = torch.empty(256, 128, device="cuda")
    x[:, :65].fill_(1.0)
    with torch.cuda.stream(s):
        x[:, 64:].fill_(2.0)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- clean
def same_stream():
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    y = x * 2
    x.fill_(3.0)
    del y
    torch.cuda.synchronize()


def wait_stream_right():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2
    torch.cuda.current_stream().wait_stream(s)
    x.fill_(3.0)
    y.add_(1)
    torch.cuda.synchronize()


def event_record_wait_right():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    e = torch.cuda.Event()
    e.record()
    s.wait_event(e)
    with torch.cuda.stream(s):
        x.add_(1.0)
    torch.cuda.synchronize()


def record_stream_right():
    (s,) = streams("side")
    with torch.cuda.stream(s):
        x = torch.empty(N, device="cuda")
        x.fill_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    y = x * 2
    x.record_stream(torch.cuda.current_stream())
    del x
    with torch.cuda.stream(s):
        z = torch.empty(N, device="cuda")
        z.fill_(5.0)
    torch.cuda.synchronize()
    del y, z


def wait_stream_instead_of_record_stream():
    (s,) = streams("side")
    with torch.cuda.stream(s):
        x = torch.empty(N, device="cuda")
        x.fill_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    y = x * 2
    del x
    s.wait_stream(torch.cuda.current_stream())  # side waits for the default stream before allocating again
    with torch.cuda.stream(s):
        z = torch.empty(N, device="cuda")
        z.fill_(5.0)
    torch.cuda.synchronize()
    del y, z


def host_sync_then_read(kind):
    def run():
        x = torch.empty(N, device="cuda")
        x.fill_(1.0)
        p = x.to("cpu", non_blocking=True)
        if kind == "stream":
            torch.cuda.current_stream().synchronize()
        elif kind == "device":
            torch.cuda.synchronize()
        elif kind == "event":
            e = torch.cuda.Event()
            e.record()
            e.synchronize()
        elif kind == "event_query":
            e = torch.cuda.Event()
            e.record()
            while not e.query():
                pass
        elif kind == "stream_query":
            while not torch.cuda.current_stream().query():
                pass
        p.sum()
    run.__name__ = f"host_sync_then_read_{kind}"
    return run


def disjoint_halves_two_streams():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x[: N // 2].fill_(1.0)
    with torch.cuda.stream(s):
        x[N // 2:].fill_(2.0)
    torch.cuda.synchronize()


def strided_columns_disjoint():
    (s,) = streams("side")
    x = torch.empty(256, 128, device="cuda")
    x[:, :64].fill_(1.0)
    with torch.cuda.stream(s):
        x[:, 64:].fill_(2.0)
    torch.cuda.synchronize()


def side_stream_only():
    (s,) = streams("side")
    with torch.cuda.stream(s):
        x = torch.empty(N, device="cuda")
        x.fill_(1.0)
        y = x * 2
        y.add_(x)
        del x, y
        z = torch.empty(N, device="cuda")
        z.fill_(0.0)
    torch.cuda.synchronize()


def blocking_d2h_on_side_stream():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    s.wait_stream(torch.cuda.current_stream())
    p = torch.empty(N).pin_memory()
    with torch.cuda.stream(s):
        p.copy_(x)  # blocking: the host waits for side
    p.sum()


def item_then_host_read():
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    p = x.to("cpu", non_blocking=True)
    x[0].item()  # synchronizes the default stream
    p.sum()


def cpu_and_tolist():
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    c = x.cpu()
    x[:4].tolist()
    x.fill_(2.0)
    del c


def pageable_nonblocking_d2h():
    (s,) = streams("side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    s.wait_stream(torch.cuda.current_stream())
    h = torch.empty(N)
    with torch.cuda.stream(s):
        h.copy_(x, non_blocking=True)  # pageable: CUDA returns after the copy
    x.fill_(2.0)  # ordered: the host waited for side, the default stream joins the host


def pinned_reuse_after_sync():
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    for _ in range(3):
        p = x.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        p.add_(1.0)
        del p


def torch_stream_context():
    s = torch.Stream(device="cuda")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    s.wait_stream(torch.cuda.current_stream())
    with s:
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    x.add_(1.0)
    torch.cuda.synchronize()


def torch_stream_context_race():
    s = torch.Stream(device="cuda")
    streamsan.name_stream(s, "side")
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    with s:
        x.add_(1.0)
    torch.cuda.synchronize()


def tolist_after_async_d2h():
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    p = x.to("cpu", non_blocking=True)
    p[:8].tolist()  # no aten op: the tracer's Tensor.tolist patch sees the read
    torch.cuda.synchronize()


def numpy_after_async_d2h():
    import numpy as np

    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    p = x.to("cpu", non_blocking=True)
    np.asarray(p).sum()
    torch.cuda.synchronize()


def tolist_after_event_synchronize():
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    p = x.to("cpu", non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    p[:8].tolist()
    p.numpy().sum()


SCENARIOS = [
    write_default_then_side_write, write_default_then_side_read, side_read_then_default_write,
    host_reads_pinned_after_async_d2h, host_writes_pinned_during_h2d, missing_record_stream,
    alloc_reuse_on_other_stream, d2h_then_h2d_pinned_across_streams, overlapping_views_two_streams,
    wait_on_unrecorded_event, wait_wrong_direction, strided_columns_overlap, torch_stream_context_race,
    same_stream, wait_stream_right, event_record_wait_right, record_stream_right,
    wait_stream_instead_of_record_stream, host_sync_then_read("stream"), host_sync_then_read("device"),
    host_sync_then_read("event"), host_sync_then_read("event_query"), host_sync_then_read("stream_query"),
    disjoint_halves_two_streams, strided_columns_disjoint, side_stream_only, blocking_d2h_on_side_stream,
    item_then_host_read, cpu_and_tolist, pageable_nonblocking_d2h, pinned_reuse_after_sync, torch_stream_context,
    tolist_after_async_d2h, numpy_after_async_d2h, tolist_after_event_synchronize,
]
# (kind, previous role, previous op, current role, current op) per scenario; shared with the CPU replay test of
# the traces these scenarios recorded (tests/replay/test_replay_fixtures.py).
EXPECTED = expected("torch_scenarios")


# The memory is x's again, freed and allocated on the default stream: the side stream's write races with that
# allocation (stream-ordered work on the default stream), where the native allocator's model sees x's old accesses.
UNDER_CUDA_MALLOC_ASYNC = {
    "alloc_reuse_on_other_stream": [("device-device", "default", "allocation", "side", "aten::fill_.Scalar")],
}

test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED,
                                                                       under_async=UNDER_CUDA_MALLOC_ASYNC)
