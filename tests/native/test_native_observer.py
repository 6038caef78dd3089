"""The native observer (``streamsan/native``) against a recording dispatch mode, on the CPU, and its build cache.

Each program runs once under both (``native_kit.observe``): every record the observer makes as the mode's view
must equal the mode's op (name, overload, thread, each tensor's storage, byte offset, sizes, strides, dtype and
device, and the call site's Python frames), in order; the mode's ops inside a record marked as not the mode's view
(autocast) are covered by that mark, and the marked record's children must equal them. Skipped, with the build's
reason, where the observer cannot be built here.
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from streamsan.native import build, observer, records  # noqa: E402
from tests.support.native_kit import Recorder, arm_new_threads, compare, observe  # noqa: E402

F = torch.nn.functional


@pytest.fixture(scope="module")
def native():
    module, reason = observer.load()
    if module is None:
        pytest.skip(reason)
    return module


def check(run, expect_marks=False):
    """The comparison, asserted: no difference outside the marks, every op accounted for."""
    c = compare(run)
    assert not c.problems, "\n".join(c.problems[:20])
    assert c.exact > 0
    if not expect_marks:
        assert c.marked == () and c.covered == 0
    assert len(run.ops) == c.exact + c.covered + c.interpreter_detaches
    return c


# ------------------------------------------------------------------ programs
def model_step(x, w, b, ln_w, ln_b, emb, idx, mask):
    """A mix of composite ops (which decompose outside inference mode), views, copies, factories and indexing."""
    h = F.linear(x, w, b)
    h = F.layer_norm(h, (h.shape[-1],), ln_w, ln_b)
    h = F.gelu(h) + torch.softmax(h, dim=-1)
    h = F.dropout(h, p=0.1, training=True)
    h = h.to(torch.float64).to(torch.float32)
    t = h.t().contiguous()
    r = t.reshape(-1)
    parts = torch.split(h, 2, dim=0)
    c = torch.cat(parts, dim=1)
    s = torch.stack([h, h]).sum(0).mean(dim=-1)
    g = h.index_select(0, idx) + h[idx]
    h2 = h.clone()
    h2[mask] = 0.0
    e = emb[idx.clamp(max=emb.shape[0] - 1)]
    q = h.unsqueeze(0).unsqueeze(0)
    a = F.scaled_dot_product_attention(q, q, q)
    z = torch.einsum("ij,kj->ik", h, h)
    m = torch.matmul(h, w) if h.shape[-1] == w.shape[0] else torch.matmul(h, h.t())
    win = torch.hann_window(8)
    ar = torch.arange(6, dtype=torch.float32).view(2, 3)
    f = torch.full((2, 2), 3.0) + torch.zeros_like(ar[:, :2])
    return (r.sum() + c.sum() + s.sum() + g.sum() + h2.sum() + e.sum() + a.sum() + z.sum() + m.sum() + win.sum()
            + f.sum())


def inputs(requires_grad=True):
    torch.manual_seed(0)
    p = dict(requires_grad=requires_grad)
    return (torch.randn(6, 8), torch.randn(5, 8, **p), torch.randn(5, **p), torch.randn(5, **p), torch.randn(5, **p),
            torch.randn(4, 3, **p), torch.tensor([0, 2, 3]), torch.rand(6, 5) > 0.5)


def inplace_and_out():
    a = torch.ones(4, 4)
    b = torch.randn(4, 4)
    a.add_(b).mul_(2.0).clamp_(min=0.0)
    out = torch.empty(4, 4)
    torch.add(a, b, out=out)
    torch.mm(a, b, out=out)
    torch.sum(a, dim=0, out=torch.empty(4))
    a.copy_(b)
    a.zero_()
    a.fill_(2.0)
    a[0] = 1.0
    a[1, 2:] = b[1, 2:]
    a.t_()
    torch.empty(0).resize_(6)


def views():
    x = torch.arange(24.0).view(2, 3, 4)
    vs = [x.view(6, 4), x.t() if x.dim() == 2 else x.transpose(0, 2), x.permute(2, 0, 1), x.unsqueeze(1),
          x.narrow(2, 1, 2), x[:, 1:], x[1], x.select(2, 0), x.as_strided((2, 2), (1, 3), 1), x[0].expand(2, 3, 4),
          x.diagonal(0, 1, 2), x.unfold(2, 2, 1), *x.chunk(2, dim=2), *x.unbind(0), x.flatten(), x.squeeze(),
          x.reshape(4, 6)]
    return sum(v.sum() for v in vs)


# ------------------------------------------------------------------ the differential
def test_grad_mode_composite_ops_decompose_as_for_the_mode(native):
    c = check(observe(model_step, *inputs()))
    assert c.exact > 40


def test_no_grad(native):
    def run():
        with torch.no_grad():
            model_step(*inputs())
    check(observe(run))


def test_inference_mode_ops_reach_the_mode_whole(native):
    def run():
        with torch.inference_mode():
            model_step(*inputs(requires_grad=False))
    r = observe(run)
    check(r)
    names = {x.name for x in r.records}
    assert {"aten::linear", "aten::matmul", "aten::reshape"} & names  # (whole, not their parts)


def test_autocast_marks_cover_every_op_whose_record_differs(native):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model_step(*inputs())
    r = observe(run)
    c = check(r, expect_marks=True)
    assert c.marked and all(flags & records.AUTOCAST for _, flags in c.marked)
    assert c.covered >= 2 * len(c.marked)  # (each: a cast, or two, and the op itself)
    assert c.children_equal  # the ops inside each mark, as the mode sees them: its children


def test_a_mode_pushed_after_start_takes_the_ops_first(native):
    """The recorder above the observed mode: each op it is handed is marked, and the calls its handler passes on
    (which the observed mode, below it, would be handed) are the mark's children."""
    r = observe(model_step, *inputs(), recorder_above=True)
    c = compare(r, sites=False, seqs=False)  # (the children: the calls the recorder's handler makes, after it)
    assert not c.problems, "\n".join(c.problems[:20])
    assert c.exact == 0 and c.marked and all(flags & records.MODE_ABOVE for _, flags in c.marked)
    assert c.children_equal and c.covered == len(r.ops)


def test_backward(native):
    def run():
        loss = model_step(*inputs())
        loss.backward()
    r = observe(run)
    check(r)
    assert any(x.name == "aten::detach" for x in r.records)  # (AccumulateGrad's)


def test_new_python_threads_are_observed_once_armed(native):
    rec_holder = {}

    barrier = threading.Barrier(4)

    def work(wait=None):
        a = torch.randn(8, 8)
        (a @ a).relu_().sum()
        if wait is not None:
            wait.wait()  # (all alive at once: each keeps its own thread id)

    def run():
        rec = rec_holder["rec"]
        threading.setprofile(arm_new_threads(rec))
        try:
            ts = [threading.Thread(target=work, args=(barrier,)) for _ in range(3)]
            for t in ts:
                t.start()
            work()
            barrier.wait()
            for t in ts:
                t.join()
        finally:
            threading.setprofile(None)

    module, _ = observer.load()
    dec = observer.decoder()
    observer.drain()
    rec = rec_holder["rec"] = Recorder(module.sequence)
    with rec:
        observer.start()
        try:
            run()
        finally:
            observer.stop()
    got, events = dec.decode(observer.drain())
    from tests.support.native_kit import Run

    r = Run(got, events, rec.ops)
    check(r)
    assert len({x.thread for x in r.records}) == 4


def test_a_thread_that_is_not_armed_is_not_observed(native):
    seen = []

    def run():
        t = threading.Thread(target=lambda: seen.append(torch.ones(3).add_(1)))
        t.start()
        t.join()

    r = observe(run)
    assert seen and not any(x.thread != threading.get_ident() for x in r.records)


def test_custom_ops_are_seen_as_the_mode_sees_them(native):
    lib = "streamsan_native_test"
    if not hasattr(test_custom_ops_are_seen_as_the_mode_sees_them, "ops"):
        @torch.library.custom_op(f"{lib}::scaled", mutates_args=())
        def scaled(x: torch.Tensor, k: float) -> torch.Tensor:
            return x * k + x.sin()

        @scaled.register_fake
        def _(x, k):
            return torch.empty_like(x)

        @torch.library.custom_op(f"{lib}::bump_", mutates_args=("x",))
        def bump_(x: torch.Tensor) -> None:
            x.add_(1.0)

        test_custom_ops_are_seen_as_the_mode_sees_them.ops = (scaled, bump_)
    scaled, bump_ = test_custom_ops_are_seen_as_the_mode_sees_them.ops

    def run():
        x = torch.randn(4, requires_grad=False)
        y = scaled(x, 2.0)
        bump_(y)
        with torch.inference_mode():
            scaled(torch.randn(3), 0.5)

    r = observe(run)
    check(r)
    names = [x.name for x in r.records]
    assert f"{lib}::scaled" in names and f"{lib}::bump_" in names
    assert "aten::sin" not in names  # (inside the custom op: the mode does not see it)


class Wrapped(torch.Tensor):
    """A wrapper subclass: its __torch_dispatch__ runs each op on the plain tensor inside."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(v):
            return v.inner if isinstance(v, Wrapped) else v

        out = func(*torch.utils._pytree.tree_map(unwrap, args),
                   **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return torch.utils._pytree.tree_map(lambda v: Wrapped(v) if isinstance(v, torch.Tensor) else v, out)


def test_tensor_subclasses_are_the_modes_view_marked_for_the_python_path(native):
    def run():
        w = Wrapped(torch.randn(3, 3))
        p = torch.randn(3, 3)
        (w + p).mul_(2.0).sum()

    r = observe(run)
    check(r)
    sub = [x for x in r.records if x.flags & records.SUBCLASS]
    assert [x.name for x in sub] == ["aten::add", "aten::mul_", "aten::sum"]


def test_torch_tensor(native):
    def run():
        torch.tensor([1, 2, 3])
        torch.tensor([[1.0, 2.0]], dtype=torch.float64)
        torch.tensor(3.5)
        torch.as_tensor([4, 5])

    r = observe(run)
    check(r)
    assert not any(x.name.startswith("aten::empty") for x in r.records)  # (made where no mode looks)


def test_in_place_and_out_ops(native):
    check(observe(inplace_and_out))


def test_views(native):
    check(observe(views))


def test_call_sites_resolve_to_the_callers_frames(native):
    def caller():
        torch.ones(2).add_(1.0)

    r = observe(caller)
    (rec,) = [x for x in r.records if x.name == "aten::add_"]
    code, lasti = rec.site[0]
    assert code is caller.__code__ and lasti >= 0
    assert len(rec.site) > 1 and rec.site[1][0] is observe.__code__


def test_no_frames_kept_when_asked_for_none(native):
    r = observe(lambda: torch.ones(2).add_(1.0), frames=0)
    assert r.records and all(x.site == () for x in r.records)


def test_stopped_it_records_nothing_more(native):
    observer.start()
    torch.ones(2).add_(1.0)
    observer.stop()
    torch.ones(2).add_(1.0)
    got, events = observer.decoder().decode(observer.drain())
    assert [x.name for x in got] == ["aten::ones", "aten::add_"]


def test_records_keep_no_tensor_alive(native):
    import weakref

    observer.start()
    t = torch.randn(100)
    ref = weakref.ref(t)
    t.mul_(2)
    del t
    observer.stop()
    assert ref() is None
    got, _ = observer.decoder().decode(observer.drain())
    assert got


def test_byte_ranges_follow_the_tracers_rule(native):
    def run():
        x = torch.randn(4, 6)
        x.t().sum()
        x[:, ::2].sum()
        x.expand(3, 4, 6).sum()

    r = observe(run)
    ranges = [records.byte_range(x.inputs[0]) for x in r.records if x.name == "aten::sum"]
    base = ranges[0][0]
    assert ranges[0] == (base, 96)
    assert ranges[1] == (base, 92, (4, (4, 3), (6, 2)))
    assert ranges[2][0] == base and ranges[2][2][2] == (0, 6, 1)


def test_the_gpu_trace_slot_is_taken_first_and_kept():
    """In a process of its own (the slot, once taken, is the process's for good): the observer installed first
    owns PyTorch's GPU-trace slot, and keeps it after torch._C._activate_gpu_trace() (the Python path)."""
    code = ("import sys; from streamsan.native import observer as o; m, why = o.load()\n"
            "if m is None: print('SKIP', why); sys.exit(0)\n"
            "import torch; owned, why = o.install_gpu_trace(); assert owned, why; assert o.owns_gpu_trace()\n"
            "torch._C._activate_gpu_trace(); assert o.owns_gpu_trace(); print('OK')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout)
    assert out.stdout.strip() == "OK"


def test_the_python_path_first_keeps_the_slot():
    code = ("import sys; from streamsan.native import observer as o; m, why = o.load()\n"
            "if m is None: print('SKIP', why); sys.exit(0)\n"
            "import torch; torch._C._activate_gpu_trace(); owned, why = o.install_gpu_trace()\n"
            "assert not owned and 'another' in why and not o.owns_gpu_trace(); print('OK')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout)
    assert out.stdout.strip() == "OK"


# ------------------------------------------------------------------ the build cache
class FakeBuilds:
    """A compiler that writes a file and counts its calls, and an importer that hands back a module naming the
    running torch."""

    def __init__(self, monkeypatch):
        import types

        self.compiled = []
        module = types.SimpleNamespace(TORCH_VERSION=torch.__version__.split("+")[0], LAYOUT=records.LAYOUT)
        monkeypatch.setattr(build, "_import", lambda name, path: module)

    def compile(self, name, source, directory):
        self.compiled.append((name, directory))
        path = directory / f"{name}.so"
        path.write_bytes(b"")
        return path


def test_a_cached_build_is_reused(tmp_path, monkeypatch):
    fake = FakeBuilds(monkeypatch)
    src = tmp_path / "observer.cpp"
    src.write_text("// one\n")
    for _ in range(2):
        module, reason = build.load_extension(src, tmp_path / "cache", fake.compile)
        assert module is not None, reason
    assert len(fake.compiled) == 1


def test_a_changed_source_rebuilds_elsewhere(tmp_path, monkeypatch):
    fake = FakeBuilds(monkeypatch)
    src = tmp_path / "observer.cpp"
    src.write_text("// one\n")
    build.load_extension(src, tmp_path / "cache", fake.compile)
    src.write_text("// two\n")
    build.load_extension(src, tmp_path / "cache", fake.compile)
    assert len(fake.compiled) == 2 and fake.compiled[0][1] != fake.compiled[1][1]
    assert all(d.parent == tmp_path / "cache" for _, d in fake.compiled)
    assert str(torch.__version__).split("+")[0] in fake.compiled[0][1].name


def test_a_build_for_another_torch_is_never_loaded(tmp_path, monkeypatch):
    fake = FakeBuilds(monkeypatch)
    src = tmp_path / "observer.cpp"
    src.write_text("// one\n")
    build.load_extension(src, tmp_path / "cache", fake.compile)
    (directory,) = (tmp_path / "cache").iterdir()
    stamp = directory / build.STAMP
    content = json.loads(stamp.read_text())
    stamp.write_text(json.dumps(dict(content, torch="1.0.0")))
    build.load_extension(src, tmp_path / "cache", fake.compile)
    assert len(fake.compiled) == 2  # (built again, not loaded)
    assert json.loads(stamp.read_text())["torch"] == torch.__version__


def test_a_library_built_for_another_torch_is_refused(tmp_path, monkeypatch):
    import types

    monkeypatch.setattr(build, "_import", lambda name, path: types.SimpleNamespace(TORCH_VERSION="1.0.0"))
    src = tmp_path / "observer.cpp"
    src.write_text("// one\n")
    module, reason = build.load_extension(src, tmp_path / "cache", FakeBuilds.compile.__get__(
        types.SimpleNamespace(compiled=[])))
    assert module is None and "1.0.0" in reason


def test_a_failing_build_gives_none_and_one_line(tmp_path, monkeypatch):
    def broken(name, source, directory):
        print("noise the program must not see")
        raise RuntimeError("Error building extension\nobserver.cpp:1:1: error: 'x' was not declared\nmore")

    src = tmp_path / "observer.cpp"
    src.write_text("// one\n")
    module, reason = build.load_extension(src, tmp_path / "cache", broken)
    assert module is None
    assert "\n" not in reason and "error: 'x' was not declared" in reason
    (directory,) = (tmp_path / "cache").iterdir()
    assert "noise" in (directory / "build.log").read_text()
    assert not (directory / build.STAMP).exists()


def test_a_missing_compiler_gives_none_and_a_reason(tmp_path):
    """The real build path with a compiler that fails: no exception, no traceback, a reason (in a process of its
    own: torch's extension builder keeps per-process state)."""
    fake_cxx = tmp_path / "no-cxx"
    fake_cxx.write_text("#!/bin/sh\necho 'error: no compiler here' >&2\nexit 1\n")
    fake_cxx.chmod(0o755)
    env = dict(os.environ, CXX=str(fake_cxx), XDG_CACHE_HOME=str(tmp_path / "cache"))
    code = ("from streamsan.native import build; m, why = build.load_extension(); "
            "assert m is None; print(why)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    reason = out.stdout.strip()
    assert reason.startswith("the native observer did not build") and "\n" not in reason
    assert "Traceback" not in out.stderr
    assert list(Path(tmp_path / "cache").rglob("build.log"))
