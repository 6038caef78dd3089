"""torch.compile under the tracer: Dynamo must never compile streamsan's own frames (the dispatch mode runs inside
compiled functions' eager parts), and the mode must not pay PyTorch's per-call Dynamo wrapper for that. CPU only:
a tensor registered as pinned makes its ops host accesses the tracer emits."""

import pytest

torch = pytest.importorskip("torch")
dynamo = pytest.importorskip("torch._dynamo")

from streamsan import events as E  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.torch.dispatch import TracingMode  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402


def test_compiled_code_runs_eagerly_under_the_tracer_and_no_streamsan_frame_is_compiled():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    def f(x):
        x.add_(1)
        print("a graph break")
        return x * 2

    events = []
    tracer = TorchTracer(EventBuffer([events.extend]))
    host = torch.zeros(8)
    tracer.pinned[host.untyped_storage().data_ptr()] = host.untyped_storage().nbytes()
    dynamo.reset()
    tracer.start()
    try:
        out = torch.compile(f, backend=backend)(host)
    finally:
        tracer.stop()
    assert out.tolist() == [2.0] * 8
    assert not any(name.startswith("L_args") or name.startswith("L_func") for g in graphs for name in g), graphs
    ops = [ev[2] for ev in events if ev[0] == E.OP]
    assert ops[:2] == ["aten::add_.Tensor", "aten::mul.Tensor"]
    assert not getattr(TracingMode.__dict__["__torch_dispatch__"], "_streamsan_dynamo_safe", False)
