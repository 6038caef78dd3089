"""Which arguments a Triton kernel writes, read from its source (streamsan.tracers.triton). CPU only: kernels are
stand-ins with the attributes of a ``triton.JITFunction`` (``src``, ``arg_names``, ``__globals__``), so Triton
itself is not needed."""

import textwrap

import pytest

from streamsan.tracers.triton import kernel_writes, written_params


class Kernel:
    """What the analysis reads of a ``triton.JITFunction``."""

    def __init__(self, src, scope=None):
        self.src = textwrap.dedent(src)
        head = self.src.split("(", 1)[1].split(")", 1)[0]
        self.arg_names = [p.split(":")[0].split("=")[0].strip() for p in head.split(",") if p.strip()]
        self.__globals__ = scope or {}
        self.__name__ = self.src.split("(", 1)[0].split()[-1]


def test_a_store_through_offsets_writes_its_pointer_only():
    k = Kernel("""
        def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)
    """)
    assert written_params(k) & {"x_ptr", "y_ptr", "out_ptr"} == {"out_ptr"}


def test_chains_of_assignments_and_in_place_updates_reach_the_store():
    k = Kernel("""
        def rows(src_ptr, dst_ptr, stride, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            dst_ptr += row * stride
            ptrs = dst_ptr + tl.arange(0, BLOCK)
            vals = tl.load(src_ptr + row * stride + tl.arange(0, BLOCK))
            out: tl.tensor = ptrs
            tl.store(pointer=out, value=vals * 2)
    """)
    assert written_params(k) & {"src_ptr", "dst_ptr"} == {"dst_ptr"}


def test_an_index_loaded_from_memory_does_not_make_its_source_written():
    k = Kernel("""
        def scatter(out_ptr, idx_ptr, src_ptr, n):
            i = tl.arange(0, 128)
            idx = tl.load(idx_ptr + i)
            tl.store(out_ptr + idx, tl.load(src_ptr + i))
            tl.atomic_add(out_ptr + tl.load(idx_ptr + i), 1.0)
    """)
    assert written_params(k) & {"out_ptr", "idx_ptr", "src_ptr"} == {"out_ptr"}


def test_atomics_block_pointers_and_descriptors_write():
    k = Kernel("""
        def k(a_ptr, b_ptr, c_ptr, d_ptr, e_ptr):
            tl.atomic_max(a_ptr, 1)
            bp = tl.make_block_ptr(base=b_ptr, shape=(16, 16), strides=(16, 1), offsets=(0, 0),
                                   block_shape=(16, 16), order=(1, 0))
            tl.store(bp, tl.zeros((16, 16), tl.float32))
            desc = tl.make_tensor_descriptor(c_ptr, shape=[16], strides=[1], block_shape=[16])
            desc.store([0], tl.load(d_ptr + tl.arange(0, 16)))
            e_vals = tl.load(e_ptr + tl.arange(0, 16))
    """)
    assert written_params(k) & {"a_ptr", "b_ptr", "c_ptr", "d_ptr", "e_ptr"} == {"a_ptr", "b_ptr", "c_ptr"}


def test_stores_of_called_jit_functions_count_by_position_and_keyword():
    helper = Kernel("""
        def helper(src, dst, n):
            tl.store(dst + tl.arange(0, 16), tl.load(src + tl.arange(0, 16)))
    """)
    ns = type("module", (), {"helper": helper})
    k = Kernel("""
        def outer(x_ptr, y_ptr, z_ptr, w_ptr):
            helper(x_ptr, y_ptr, 16)
            helper(src=z_ptr, dst=w_ptr, n=16)
            ns.helper(x_ptr, z_ptr, 16)
    """, {"helper": helper, "ns": ns})
    assert written_params(k) & {"x_ptr", "y_ptr", "z_ptr", "w_ptr"} == {"y_ptr", "w_ptr", "z_ptr"}


def test_a_callee_without_source_writes_what_it_is_given():
    opaque = Kernel("def opaque(a, b):\n    pass\n")
    opaque.src = None
    k = Kernel("""
        def outer(x_ptr, y_ptr):
            opaque(x_ptr, 1)
            tl.load(y_ptr)
    """, {"opaque": opaque})
    assert written_params(k) & {"x_ptr", "y_ptr"} == {"x_ptr"}


@pytest.mark.parametrize("src", [None, "def broken(x_ptr:\n", "x = 1\n"])
def test_unreadable_source_is_none(src):
    k = Kernel("def k(x_ptr):\n    pass\n")
    k.src = src
    assert written_params(k) is None


def test_each_kernel_is_analyzed_once():
    k = Kernel("def k(x_ptr):\n    tl.store(x_ptr, 1)\n")
    assert kernel_writes(k) == {"x_ptr"}
    k.src = "def k(x_ptr):\n    pass\n"
    assert kernel_writes(k) == {"x_ptr"}


# ------------------------------------------------------------------ the torch tracer's launch patch
torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch import device  # noqa: E402
from streamsan.tracers.torch.cuda_graphs import end_capture  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402
from tests.support.torch_kit import cuda_like  # noqa: E402


def fake_triton():
    """A module with ``runtime.jit.JITFunction`` whose ``run`` records its launches."""
    launches = []

    class JITFunction:
        def run(self, *args, grid, warmup, **kwargs):
            launches.append((self.__name__, warmup))
            return "kernel"

    runtime = type("runtime", (), {"jit": type("jit", (), {"JITFunction": JITFunction})})
    return type("triton", (), {"runtime": runtime}), JITFunction, launches


def launchable(cls, src):
    k = cls()
    spec = Kernel(src)
    k.src, k.arg_names, k.__globals__, k.__name__ = spec.src, spec.arg_names, {}, spec.__name__
    return k


@pytest.fixture
def tracer(monkeypatch):
    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x77)
    t = TorchTracer(EventBuffer([lambda events: None]))
    t.start()
    yield t
    t.stop()


def test_a_launch_is_an_op_on_the_current_stream(tracer):
    module, cls, launches = fake_triton()
    orig = cls.run
    tracer.patch_triton(module)
    k = launchable(cls, """
        def scale(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 2)
    """)
    x, out = cuda_like(16), cuda_like(16)
    assert k.run(x, out, 16, grid=(1,), warmup=False, BLOCK=16) == "kernel"
    k.run(x, out, 16, grid=(1,), warmup=True, BLOCK=16)  # compiles only: no op
    ops = [ev for ev in tracer.buffer.events if ev[0] == E.OP]
    assert [(ev[1], ev[2], ev[3], ev[4]) for ev in ops] == [
        (tracer.agent(0, 0x77), "triton:scale", ((0, x.data_ptr(), 64),), ((0, out.data_ptr(), 64),))]
    assert launches == [("scale", False), ("scale", True)]
    tracer.stop()
    assert cls.run is orig


def test_a_launch_during_graph_capture_is_kept_for_the_replays(tracer):
    module, cls, _ = fake_triton()
    tracer.patch_triton(module)
    k = launchable(cls, "def fill(out_ptr):\n    tl.store(out_ptr, 1.0)\n")
    out = cuda_like(4)
    tracer.graphs.current = ([], [], True, [])
    tracer.tracing = False
    k.run(out, grid=(1,), warmup=False)
    cap = tracer.graphs.current
    end_capture(tracer, None)
    assert cap[:2] == ([], [(0, out.data_ptr(), 16)])
    assert not [ev for ev in tracer.buffer.events if ev[0] == E.OP]


def test_a_kernel_without_source_writes_every_tensor_with_a_note(tracer):
    module, cls, _ = fake_triton()
    tracer.patch_triton(module)
    k = launchable(cls, "def opaque(a, b):\n    pass\n")
    k.src = None
    a, b = cuda_like(4), cuda_like(4)
    k.run(a, b, grid=(1,), warmup=False)
    (op,) = [ev for ev in tracer.buffer.events if ev[0] == E.OP]
    assert op[3] == () and len(op[4]) == 2
    assert any("cannot read" in ev[2] for ev in tracer.buffer.events if ev[0] == E.NOTE)


def test_stores_imported_by_name_write_too():
    k = Kernel("""
        def k(x_ptr, y_ptr):
            store(y_ptr + tl.arange(0, 16), tl.load(x_ptr + tl.arange(0, 16)))
            atomic_add(x_ptr, 0.0)
    """)
    assert written_params(k) & {"x_ptr", "y_ptr"} == {"x_ptr", "y_ptr"}
