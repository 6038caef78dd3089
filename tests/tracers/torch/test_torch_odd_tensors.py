"""The tracer never changes what a program computes, whatever tensors it meets: sparse, nested, complex views,
quantized, meta, subclasses, fake tensors, zero-size and zero-dim tensors, resized storage, autograd, NumPy
round trips. CPU: each case runs untraced and traced, with its CPU tensors registered as pinned memory so that
every op takes the tracer's host-access path; results must match and the tracer must add no warnings."""

import warnings

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from streamsan.analysis.analyzer import Analyzer  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.pinned import PinnedBlocks  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402

PINNED = PinnedBlocks()  # the pinned blocks the cases make, the tracer's own


def pin(t):
    st = t.untyped_storage()
    PINNED[st.data_ptr()] = st.nbytes()
    return t


def sparse_coo():
    v = pin(torch.tensor([3.0, 4.0]))
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), v, (2, 2), check_invariants=True)
    return (s + s).to_dense().sum().item(), s.coalesce().values().tolist()


def sparse_csr():
    d = pin(torch.eye(3))
    return (d.to_sparse_csr() @ d).sum().item()


def nested():
    a = pin(torch.ones(2, 3))
    return (torch.nested.nested_tensor([a, torch.ones(4, 3)]) * 2).to_padded_tensor(0).sum().item()


def complex_views():
    c = pin(torch.arange(8, dtype=torch.float32).view(torch.complex64))
    return torch.view_as_real(c).sum().item(), c.conj().resolve_conj().abs().sum().item(), c.conj().tolist()


def quantized():
    x = pin(torch.linspace(-1, 1, 8))
    q = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
    return q.dequantize().sum().item(), q.int_repr().tolist()


def meta():
    return tuple((torch.empty(3, device="meta") + 1).shape)


def expanded():
    x = pin(torch.ones(1, 4))
    return x.expand(3, 4).contiguous().sum().item(), x.expand(3, 4).tolist()


def empty_and_zero_dim():
    x = pin(torch.tensor(3.0))
    return x.item(), (torch.empty(0) + 1).tolist(), x.tolist(), x.numpy().tolist()


class Sub(torch.Tensor):
    pass


def subclass():
    x = pin(torch.ones(3)).as_subclass(Sub)
    return (x + 1).tolist(), float(x.numpy().sum())


def wrapper_subclass():
    """A subclass wrapping other tensors (as DTensor does): its ops run on the inner tensors."""
    from torch.testing._internal.two_tensor import TwoTensor

    w = TwoTensor(pin(torch.ones(4)), pin(torch.zeros(4)))
    v = (w * 2).mul_(3)
    e = torch.empty_like(w)
    return v.a.tolist(), v.b.tolist(), tuple(e.shape), torch.stack([w, w]).a.shape[0]


def fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    pin(torch.ones(1))  # the tracer now looks at CPU tensors' pointers
    with FakeTensorMode():
        y = torch.ones(4) * 2
    return tuple(y.shape)


def bools():
    x = pin(torch.ones(8, dtype=torch.bool))
    return x.logical_not().tolist(), torch.ones(2, dtype=torch.uint8).view(torch.bool).tolist()


def resized():
    x = pin(torch.ones(4))
    x.resize_(8)
    return tuple(x.shape)


def autograd():
    w = pin(torch.ones(3, requires_grad=True).detach().requires_grad_())
    (w * 2).sum().backward()
    return w.grad.tolist()


def numpy_round_trip():
    x = pin(torch.from_numpy(np.arange(6.0)))
    return float(np.asarray(x).sum()), float(x.numpy(force=True).sum())


CASES = [sparse_coo, sparse_csr, nested, complex_views, quantized, meta, expanded, empty_and_zero_dim, subclass,
         wrapper_subclass, fake_tensors, bools, resized, autograd, numpy_round_trip]


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__)
def test_traced_results_match_untraced(case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = case()
    analyzer = Analyzer()
    tracer = TorchTracer(EventBuffer([analyzer.feed]))
    notes = []
    tracer.on_note = notes.append
    PINNED.clear()
    tracer.pinned = PINNED
    tracer.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = case()
    finally:
        tracer.stop()
    assert got == expected
    ours = [str(w.message) for w in caught if "streamsan" in (w.filename or "")]
    assert ours == []
    analyzer.finish()
    assert analyzer.sorted_findings() == []
    if case in (sparse_coo,):
        assert notes == ["torch.sparse_coo tensors are not analyzed (streamsan follows strided memory only)"]
