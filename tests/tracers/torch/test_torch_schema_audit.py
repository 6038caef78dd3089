"""Where op schemas do not say what a kernel touches, checked against PyTorch's own knowledge, so that a new
torch's ops cannot slip past the tracer's lists (``streamsan/tracers/torch/rules.py``: ``SCHEMA_HIDES``,
``STATISTICS_WRITES``, ``NO_ACCESS``). CPU only."""

import warnings

import pytest

torch = pytest.importorskip("torch")

from streamsan.tracers.torch.rules import OpPlan  # noqa: E402

TRAINING_FLAGS = ("training", "train", "use_input_stats")


def _aten_overloads():
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        packet = getattr(torch.ops.aten, name[len("aten::"):].split(".")[0], None)
        if packet is None:
            continue
        for overload in packet.overloads():
            yield getattr(packet, overload)


def _run_samples(mode, inference=False, skip=()):
    """Every op of PyTorch's op database on its first three CPU float32 samples, under ``mode`` (in inference mode
    or not); samples that fail are passed over. Returns how many ran."""
    pytest.importorskip("expecttest")
    from torch.testing._internal.common_methods_invocations import op_db

    warnings.simplefilter("ignore")  # (the samples' own deprecation warnings; pytest restores the filters)
    ran = 0
    for op in op_db:
        if op.name in skip:
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:3]
        except Exception:
            continue
        for s in samples:
            try:
                with torch.inference_mode(inference), mode:
                    op(s.input, *s.args, **s.kwargs)
            except Exception:
                continue
            ran += 1
    return ran


def test_every_write_in_training_that_pytorch_knows_of_is_a_write_here():
    """PyTorch's SchemaInfo knows which arguments a kernel writes in training though its schema does not say so
    (batch norm's running statistics): each such op is decomposed here, or has those arguments as writes."""
    info_of = torch._C._SchemaInfo
    missing, seen = [], 0
    for op in _aten_overloads():
        schema = op._schema
        flags = {a.name: True for a in schema.arguments if a.name in TRAINING_FLAGS}
        if not flags:
            continue
        info = info_of(schema)
        info.add_argument_values(flags)
        hidden = [a.name for i, a in enumerate(schema.arguments)
                  if "Tensor" in str(a.type) and not (a.alias_info is not None and a.alias_info.is_write)
                  and info.is_mutable(torch._C._SchemaArgument(torch._C._SchemaArgType.input, i))]
        if not hidden:
            continue
        seen += 1
        plan = OpPlan(op)
        if plan.decompose is not None:
            continue
        written = {n for _p, n, w, _l in (plan.training_args[1] if plan.training_args else ()) if w}
        if not set(hidden) <= written:
            missing.append((str(op), hidden))
    assert seen >= 4 and missing == []


@pytest.mark.parametrize("inference", [True, False], ids=["inference_mode", "grad_mode"])
def test_every_op_that_returns_an_input_though_its_schema_says_new_memory_is_known(inference):
    """Run PyTorch's op database's samples (in inference mode, composite ops reach a dispatch mode whole): an op
    whose result shares its input's memory while its schema says new memory must be one the tracer runs
    through its decomposition, or takes for no access."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def storages(x):
        if isinstance(x, torch.Tensor):
            try:
                return {x.untyped_storage().data_ptr()} if x.layout == torch.strided and x.numel() else set()
            except RuntimeError:
                return set()
        if isinstance(x, (list, tuple)):
            return set().union(*(storages(y) for y in x)) if x else set()
        return set()

    class Returns(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.aliasing = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            schema = func._schema
            if schema.returns and all(r.alias_info is None for r in schema.returns):
                ins = storages(list(args) + list((kwargs or {}).values()))
                if ins & storages(out):
                    self.aliasing.add(func)
            return out

    mode = Returns()
    assert _run_samples(mode, inference) > 1000
    assert not inference or torch.ops.aten.dropout.default in mode.aliasing  # (the audit sees them)
    unhandled = sorted(str(f) for f in mode.aliasing if OpPlan(f).decompose is None and not OpPlan(f).skip)
    assert unhandled == []


# Functions whose CPU kernels change their input as scratch space (``_fft_c2r``; CUDA's clones it first)
CPU_SCRATCH = {"fft.hfft2", "fft.hfftn"}


def test_every_input_an_op_changes_is_a_write_of_its_plan():
    """Run PyTorch's op database's samples and compare each op's tensor arguments before and after it: an argument
    whose values changed must be a write of the tracer's plan for the op (its schema's ``(a!)``, or batch norm's
    statistics in training)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Changes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.unmarked = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            plan = OpPlan(func)
            targs = plan.tensor_args
            if plan.training_args is not None:
                at = plan.training_args[0]
                if (args[at] if at < len(args) else kwargs.get("training")) is True:
                    targs = plan.training_args[1]
            before = []
            for pos, name, is_write, is_list in targs:
                v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
                for t in (v if is_list and v is not None else (v,)):
                    if isinstance(t, torch.Tensor) and not is_write and t.layout == torch.strided and t.numel():
                        before.append((name, t, t.clone()))
            out = func(*args, **kwargs)
            for name, t, old in before:
                if not torch.equal(t, old) and not (t.is_floating_point() and torch.isnan(old).any()):
                    self.unmarked.add((str(func), name))
            return out

    mode = Changes()
    assert _run_samples(mode, skip=CPU_SCRATCH) > 1000
    assert sorted(mode.unmarked) == []
