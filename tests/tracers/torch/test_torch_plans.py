"""The torch tracer's read/write sets per op schema (CPU: only the schemas are needed)."""

import pytest

torch = pytest.importorskip("torch")

from streamsan.tracers.torch.rules import OpPlan, direct_call  # noqa: E402

aten = torch.ops.aten


def shape(op):
    p = OpPlan(op)
    return {"reads": [n for _, n, w, _ in p.tensor_args if not w], "writes": [n for _, n, w, _ in p.tensor_args if w],
            "fresh": p.fresh_outputs, "skip": p.skip}


@pytest.mark.parametrize("op, expected", [
    (aten.add.Tensor, {"reads": ["self", "other"], "writes": [], "fresh": True, "skip": False}),
    (aten.add_.Tensor, {"reads": ["other"], "writes": ["self"], "fresh": False, "skip": False}),
    (aten.add.out, {"reads": ["self", "other"], "writes": ["out"], "fresh": False, "skip": False}),
    (aten.cat.default, {"reads": ["tensors"], "writes": [], "fresh": True, "skip": False}),
    (aten.copy_.default, {"reads": ["src"], "writes": ["self"], "fresh": False, "skip": False}),
    (aten._to_copy.default, {"reads": ["self"], "writes": [], "fresh": True, "skip": False}),
    (aten.index_put_.default, {"reads": ["indices", "values"], "writes": ["self"], "fresh": False, "skip": False}),
    (aten.fill_.Scalar, {"reads": [], "writes": ["self"], "fresh": False, "skip": False}),
    (aten.view.default, {"reads": [], "writes": [], "fresh": False, "skip": True}),
    (aten.slice.Tensor, {"reads": [], "writes": [], "fresh": False, "skip": True}),
    (aten.transpose_.default, {"reads": [], "writes": [], "fresh": False, "skip": True}),
    (aten.zeros_like.default, {"reads": [], "writes": [], "fresh": True, "skip": False}),
    (aten.empty.memory_format, {"reads": [], "writes": [], "fresh": True, "skip": True}),
    (aten.record_stream.default, {"reads": [], "writes": ["self"], "fresh": False, "skip": True}),
    (aten._local_scalar_dense.default, {"reads": ["self"], "writes": [], "fresh": False, "skip": False}),
    (aten._foreach_add_.List, {"reads": ["other"], "writes": ["self"], "fresh": False, "skip": False}),
    (aten.max.dim, {"reads": ["self"], "writes": [], "fresh": True, "skip": False}),
    (aten.split.Tensor, {"reads": [], "writes": [], "fresh": False, "skip": True}),
    # optional tensors (``Tensor?``, spelt Optional[Tensor]) are read too: a bias, a norm's weight, a mask
    (aten.addmm.default, {"reads": ["self", "mat1", "mat2"], "writes": [], "fresh": True, "skip": False}),
    (aten.native_layer_norm.default, {"reads": ["input", "weight", "bias"], "writes": [], "fresh": True,
                                      "skip": False}),
    (aten._scaled_dot_product_efficient_attention.default, {
        "reads": ["query", "key", "value", "attn_bias"], "writes": [], "fresh": True, "skip": False}),
    (aten.batch_norm_gather_stats_with_counts.default, {
        "reads": ["input", "mean", "invstd", "counts"], "writes": ["running_mean", "running_var"], "fresh": True,
        "skip": False}),
])
def test_plan(op, expected):
    assert shape(op) == expected


def test_collectives_write_every_tensor_they_take_and_wait_tensor_is_a_wait():
    if not torch.distributed.is_available():
        pytest.skip("this torch has no torch.distributed")

    c10d = torch.ops.c10d
    assert shape(c10d.allreduce_.default)["writes"] == ["tensors"]
    assert shape(c10d.allgather_.default)["writes"] == ["output_tensors", "input_tensors"]
    assert OpPlan(c10d.allgather_.default).collective
    assert shape(torch.ops._c10d_functional.wait_tensor.default)["skip"]
    assert not OpPlan(aten.add.Tensor).collective


def test_list_arguments_are_marked():
    p = OpPlan(aten.cat.default)
    assert [(n, is_list) for _, n, _, is_list in p.tensor_args] == [("tensors", True)]


def test_the_tracer_keeps_key_sharing_instance_dicts():
    """The hot path loads many tracer attributes per op: the instance must stay under CPython's limit for
    key-sharing dicts (see TorchTracer.__init__), also once started."""
    from streamsan.sink import EventBuffer
    from streamsan.tracers.torch.tracer import MAX_ATTRIBUTES, TorchTracer

    tracer = TorchTracer(EventBuffer([lambda events: None]))
    tracer.start()
    try:
        assert len(vars(tracer)) < MAX_ATTRIBUTES
    finally:
        tracer.stop()
    assert len(vars(tracer)) < MAX_ATTRIBUTES


def test_plans_call_the_ops_handle_and_anything_unusual_as_it_is():
    add = torch.ops.aten.add.Tensor
    assert OpPlan(add).call is add._op  # OpOverload.__call__ only forwards to it: one Python frame less per op
    a = torch.ones(3)
    assert OpPlan(add).call(a, a).tolist() == [2.0, 2.0, 2.0]

    class Overload(type(add)):
        def __call__(self, *args, **kwargs):
            return "more"

    odd = object.__new__(Overload)
    odd._op = add._op
    assert direct_call(odd) is odd
