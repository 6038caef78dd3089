"""The C tracer against the Python tracer on real CUDA programs: the same events and the same findings.

Each program runs once untraced (so that the caching allocator is warm and hands out the same blocks in the same
order after), then under ``streamsan.watch()`` with the C tracer and with ``STREAMSAN_CORE=python``. Events are
compared with pointers renamed in order of first appearance; findings as (kind, roles, ops)."""

import bisect
import itertools
import os

import pytest
import torch

from tests.gpu.support.scenario_kit import summarize

try:
    from streamsan import _ctracer
except ImportError:
    _ctracer = None

pytestmark = pytest.mark.skipif(_ctracer is None or not _ctracer.AVAILABLE, reason="the C tracer is not built")


def side_stream_race():
    side = torch.cuda.Stream()
    x = torch.randn(1 << 16, device="cuda")
    y = x * 2
    with torch.cuda.stream(side):
        z = y + 1  # reads y without waiting for the default stream: a race
        w = z.t() if z.dim() == 2 else z.view(-1, 64).t().contiguous()  # a strided read
    side.synchronize()
    return x, y, z, w


def missing_record_stream():
    side = torch.cuda.Stream()
    a = torch.randn(1 << 16, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b = a.sum() + a.mean()
    del a  # freed while the side stream may still read it, without record_stream
    c = torch.empty(1 << 16, device="cuda")  # the block handed out again
    c.fill_(3.0)
    torch.cuda.synchronize()
    return b, c


def offloaded_decode():
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = Qwen3ForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, 1000, (1, 16), device="cuda")
    with torch.no_grad():
        cache = DynamicCache(config=model.config, offloading=True)
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    return tok


def canonical(events):
    """Events with pointers, stream handles and event handles renamed in order of first appearance (each run of a
    program gets other streams from PyTorch's pool, and other CUDA events); an event is named by its last record (a
    handle recorded again, or deleted and made again, is a new name), and deletions are left out (they follow
    Python's garbage collection). A pointer into memory
    allocated while tracing is named by its allocation (the how-manieth) and its offset there: whether the pinned
    allocator hands a block out again depends on whether the GPU finished with it, a matter of timing."""
    names: dict = {}
    handles: dict = {}
    lives = itertools.count()
    allocations = itertools.count()
    bases: list = []  # sorted bases of the live allocations
    live: dict = {}  # base -> (size, name)

    def tup(x):
        return tuple(tup(y) for y in x) if isinstance(x, (list, tuple)) else x

    def ptr(p):
        i = bisect.bisect_right(bases, p) - 1
        if i >= 0:
            base = bases[i]
            size, name = live[base]
            if p == base or p < base + size:
                return (name, p - base)
        return names.setdefault(p, len(names))

    def handle(h):
        return handles.setdefault(h, next(lives))

    out = []
    for ev in map(tup, events):
        if ev[0] == 9:  # ALLOC
            if ev[2] not in live:
                bisect.insort(bases, ev[2])
            live[ev[2]] = (ev[3], f"a{next(allocations)}")
            ev = ev[:2] + (live[ev[2]][1],) + ev[3:]
        elif ev[0] == 10:  # FREE
            name = ptr(ev[2])
            if ev[2] in live:
                del live[ev[2]]
                bases.remove(ev[2])
            ev = ev[:2] + (name,) + ev[3:]
        elif ev[0] in (11, 12):  # RECORD_STREAM, LABEL
            ev = ev[:2] + (ptr(ev[2]),) + ev[3:]
        elif ev[0] == 2:  # STREAM
            ev = ev[:3] + (handle(ev[3]),) + ev[4:]
        elif ev[0] == 13:  # EVENT_DELETE: when Python collects a torch.cuda.Event is not the tracer's business;
            handles.pop(ev[1], None)  # the handle's next use is a new event
            continue
        elif ev[0] == 3:  # EVENT_RECORD: the event is this record from now on (the pinned allocator's pooled
            handles[ev[1]] = next(lives)  # events come back in an order that depends on what the GPU finished)
            ev = (ev[0], handles[ev[1]]) + ev[2:]
        elif ev[0] in (4, 6):  # EVENT_WAIT, EVENT_SYNC: of the event's last record
            ev = (ev[0], handles.setdefault(ev[1], next(lives))) + ev[2:]
        elif ev[0] == 8:  # OP
            ev = ev[:3] + (tuple((r[0], ptr(r[1])) + r[2:] for r in ev[3]),
                           tuple((r[0], ptr(r[1])) + r[2:] for r in ev[4])) + ev[5:]
        out.append(ev)
    return out


def traced(fn, core, tmp_path):
    import streamsan
    from streamsan.trace import TraceReader

    path = str(tmp_path / f"{fn.__name__}-{core}.sstrace")
    if core == "python":
        os.environ["STREAMSAN_CORE"] = "python"
    try:
        torch.cuda.synchronize()
        with streamsan.watch(trace=path) as s:
            fn()
        torch.cuda.synchronize()
    finally:
        os.environ.pop("STREAMSAN_CORE", None)
    events = [ev for batch in TraceReader(path).batches() for ev in batch]
    return canonical(events), summarize(s)


@pytest.mark.parametrize("fn", [side_stream_race, missing_record_stream, offloaded_decode])
def test_c_and_python_tracers_agree(fn, tmp_path):
    fn()  # warm: the caching allocator's blocks exist
    fn()
    (c_events, c_findings), (py_events, py_findings) = [
        traced(fn, core, tmp_path) for core in ("c", "python")]  # (one call site: the same stacks)
    assert c_findings == py_findings
    assert c_findings  # every program here has a race
    assert c_events == py_events
