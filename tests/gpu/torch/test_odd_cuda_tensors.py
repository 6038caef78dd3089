"""The tracer never changes what a program computes, whatever CUDA tensors it meets: wrapper subclasses with and
without ``__tensor_flatten__``, jagged nested tensors, sparse tensors, complex and conjugate views, expanded
(stride 0) and zero-size tensors, float8. Each case runs untraced and traced; results must match and nothing is
reported (the cases use one stream)."""

import pytest
import torch
from torch.utils._pytree import tree_map
from tests.gpu.support.scenario_kit import findings_of, untraced_then_traced



class LegacyWrapper(torch.Tensor):
    """A wrapper subclass in the older style: no ``__tensor_flatten__`` (streamsan cannot see its inner tensor)."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.elem if isinstance(x, LegacyWrapper) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: LegacyWrapper(x) if isinstance(x, torch.Tensor) else x, out)


def legacy_wrapper():
    w = LegacyWrapper(torch.arange(8.0, device="cuda"))
    v = (w * 2 + 1).mul_(3)
    return v.elem.tolist(), torch.empty_like(w).shape


def flatten_wrapper():
    from torch.testing._internal.two_tensor import TwoTensor

    w = TwoTensor(torch.ones(8, device="cuda"), torch.zeros(8, device="cuda"))
    v = (w * 2).add_(1)
    z = torch.zeros_like(w)
    return v.a.tolist(), v.b.tolist(), z.a.tolist(), torch.cat([w, w]).a.shape[0]


def jagged_nested():
    nt = torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(5, 4)], layout=torch.jagged, device="cuda")
    out = torch.nn.functional.relu(nt * 2) + 1
    return [t.sum().item() for t in out.unbind()]


def sparse():
    i = torch.tensor([[0, 1, 2], [2, 0, 1]], device="cuda")
    s = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0, 3.0], device="cuda"), (3, 3))
    return (s + s).to_dense().tolist(), torch.sparse.mm(s, torch.ones(3, 2, device="cuda")).tolist()


def complex_views():
    c = torch.arange(8, dtype=torch.float32, device="cuda").view(torch.complex64)
    return torch.view_as_real(c.conj().resolve_conj()).sum().item(), (c.conj() * c).real.sum().item()


def expanded_and_empty():
    x = torch.ones(1, 4, device="cuda")
    e = x.expand(3, 4)
    return e.contiguous().sum().item(), (torch.empty(0, device="cuda") + 1).tolist(), e.sum(0).tolist()


def float8():
    x = torch.linspace(-2, 2, 16, device="cuda").to(torch.float8_e4m3fn)
    return x.to(torch.float32).tolist()


CASES = [legacy_wrapper, flatten_wrapper, jagged_nested, sparse, complex_views, expanded_and_empty, float8]


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__)
def test_traced_results_match_untraced(case):
    expected, got, session = untraced_then_traced(case)
    assert got == expected
    assert findings_of(session) == []
