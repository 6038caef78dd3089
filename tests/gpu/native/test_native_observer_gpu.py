"""The native observer on CUDA: the CPU differential (tests/support/native_kit.py) on CUDA tensors on two streams, with
each record's stream the current stream at the op; backward on the autograd engine's device thread; and the
GPU-trace events taken through PyTorch's trace slot (native_trace_program.py, in processes of their own), in
order with the ops by sequence number. Each test prints a short summary (``pytest -s`` shows it).
"""

import json
import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

from streamsan.analysis.locations import is_library_frame  # noqa: E402
from streamsan.native import observer, records  # noqa: E402
from tests.support import native_kit  # noqa: E402
from tests.support.native_kit import compare, observe  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
F = torch.nn.functional


@pytest.fixture(scope="module")
def native():
    module, reason = observer.load()
    if module is None:
        pytest.skip(reason)
    return module


def check(run, name, expect_marks=False):
    c = compare(run, check_streams=True)
    print(f"\n[native observer, {name}] {c.exact} records equal to the mode's ops (streams too), {c.covered} mode "
          f"ops covered by {len(c.marked)} marks (children equal: {c.children_equal}), {c.interpreter_detaches} "
          f"interpreter detaches, {c.sites_below_python} call sites below torch's Python frames, "
          f"threads {len({r.thread for r in run.records})}")
    assert not c.problems, "\n".join(c.problems[:20])
    assert c.exact > 0
    if not expect_marks:
        assert c.covered == 0
    assert len(run.ops) == c.exact + c.covered + c.interpreter_detaches
    return c


def two_streams(requires_grad=False):
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    x = torch.randn(64, 32, device="cuda")
    w = torch.randn(48, 32, device="cuda", requires_grad=requires_grad)
    b = torch.randn(48, device="cuda", requires_grad=requires_grad)
    h = F.linear(x, w, b).relu()
    done = torch.cuda.Event()
    done.record()
    with torch.cuda.stream(side):
        side.wait_event(done)
        g = F.gelu(h) * 2
        g.add_(1.0)
        host = torch.empty(g.shape, pin_memory=True)
        host.copy_(g, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    out = torch.cat([h, g]).softmax(-1).sum()
    torch.tensor([1, 2, 3], device="cuda").sum()
    side.synchronize()
    return out


def test_two_streams_each_record_on_the_current_stream(native):
    r = observe(two_streams)
    check(r, "two streams")
    streams = {x.stream for x in r.records if x.stream is not None}
    assert len(streams) == 2  # (the default stream and the side stream)


def test_inference_mode_on_cuda(native):
    def run():
        with torch.inference_mode():
            two_streams()
    check(observe(run), "inference mode")


def test_autocast_on_cuda(native):
    def run():
        with torch.autocast("cuda", dtype=torch.float16):
            two_streams()
    r = observe(run)
    c = check(r, "autocast", expect_marks=True)
    assert c.marked and c.children_equal


def test_backward_on_the_engines_device_thread(native):
    def run():
        two_streams(requires_grad=True).backward()
        torch.cuda.synchronize()
    r = observe(run)
    check(r, "backward")
    main = threading.get_ident()
    engine = {x.thread for x in r.records if x.thread != main}
    assert engine, "no backward op on an autograd engine thread"
    # no frame of the program there: an engine thread runs Python only for the recorder's own handling (a record
    # made while it runs has its frames and torch's as its call site)
    foreign = [(x.name, x.site) for x in r.records if x.thread in engine
               if any(not (is_library_frame(c.co_filename) or c.co_filename == native_kit.__file__) for c, _ in x.site)]
    assert not foreign, foreign[:5]


def run_program(which):
    out = subprocess.run([sys.executable, os.path.join(HERE, "native_trace_program.py"), which],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


def test_gpu_trace_events_through_the_slot_in_order_with_the_ops():
    res = run_program("native-first")
    assert res["owned"], res["reason"]
    recs = res["records"]
    evs = res["events"]
    kinds = [e[2] for e in evs]
    print(f"\n[native observer, GPU trace] {len(recs)} records, {len(evs)} events: "
          + ", ".join(f"{k}={kinds.count(v)}" for k, v in (
              ("alloc", records.ALLOC), ("free", records.FREE), ("create", records.EVENT_CREATE),
              ("record", records.EVENT_RECORD), ("wait", records.EVENT_WAIT), ("event sync", records.EVENT_SYNC),
              ("stream sync", records.STREAM_SYNC), ("device sync", records.DEVICE_SYNC),
              ("delete", records.EVENT_DELETE)))
          + f"; slot kept after the Python path: {res['owned_after_python_path']}")
    for kind in (records.ALLOC, records.FREE, records.EVENT_CREATE, records.EVENT_RECORD, records.EVENT_WAIT,
                 records.EVENT_SYNC, records.STREAM_SYNC, records.DEVICE_SYNC, records.EVENT_DELETE):
        assert kind in kinds, kind
    seqs = sorted([r[0] for r in recs] + [e[0] for e in evs])
    assert len(set(seqs)) == len(seqs)  # one counter for both
    # the first allocation is the empty's own: inside its record, on its thread
    (empty,) = [r for r in recs if r[3] == "aten::empty"][:1]
    first_alloc = next(e for e in evs if e[2] == records.ALLOC)
    assert empty[0] < first_alloc[0] < empty[1] and first_alloc[1] == empty[2] and first_alloc[3] == 0
    # the event recorded on the default stream, then waited on by the side stream
    rec = next(e for e in evs if e[2] == records.EVENT_RECORD)
    wait = next(e for e in evs if e[2] == records.EVENT_WAIT)
    assert rec[4] == wait[4] == res["done_event"] and rec[5] == res["default_handle"] and \
        wait[5] == res["side_handle"] and rec[0] < wait[0]
    fill = next(r for r in recs if r[3] == "aten::fill_")
    mul = next(r for r in recs if r[3] == "aten::mul")
    assert fill[0] < rec[0] < wait[0] < mul[0]
    assert mul[4][2] == res["side_stream"] and fill[4][2] == res["current_stream"]
    sync_seqs = [e[0] for e in evs if e[2] in (records.EVENT_SYNC, records.STREAM_SYNC, records.DEVICE_SYNC)]
    assert all(s > mul[0] for s in sync_seqs)
    assert res["owned_after_python_path"]
    assert res["forwarded"] and res["forwarded"] == res["forward_native"]


def test_the_python_path_first_keeps_the_slot_from_the_observer():
    res = run_program("python-first")
    print(f"\n[native observer, Python path first] owned: {res['owned']} ({res['reason']})")
    assert not res["owned"] and not res["owns"] and res["reason"]
