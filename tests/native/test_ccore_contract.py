"""The contract between the torch tracer and its C core: every name ``streamsan/_ctracer.c`` reads or calls is one
``streamsan/tracers/torch/ccore.py`` lists (and the objects it names have it), and the constants the core works
with come from the Python definitions at ``configure``, laid out as the tuples really are."""

import os
import re
import threading

import pytest

torch = pytest.importorskip("torch")

from streamsan import events as E  # noqa: E402
from streamsan import stacks  # noqa: E402
from streamsan.sink import EventBuffer  # noqa: E402
from streamsan.tracers.indices import IndexValues  # noqa: E402
from streamsan.tracers.torch import ccore, placement, rules  # noqa: E402
from streamsan.tracers.torch.callbacks import GpuTrace  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from streamsan.tracers.torch.tracer import TorchTracer  # noqa: E402

SOURCE = os.path.join(ROOT, "streamsan", "_ctracer.c")


@pytest.fixture(scope="module")
def source():
    with open(SOURCE) as f:
        return f.read()


def interned(source) -> dict:
    """C variable -> the name it interns."""
    return dict(re.findall(r'INTERN\((s_\w+), "(\w+)"\);', source))


def test_every_name_the_core_interns_is_listed_and_only_those(source):
    names = set(interned(source).values())
    listed = set().union(*(ccore.members(p) for p in ccore.PROTOCOLS))
    assert names == listed


def test_the_core_reads_and_calls_names_only_through_interned_strings(source):
    """Every ``s_*`` variable the code uses is interned, and no attribute is read or called by a string literal
    (the layouts' field names are keys of configure's arguments, checked below)."""
    used = set(re.findall(r"\bs_\w+\b", source))
    assert used == set(interned(source))
    assert not re.search(r"GetAttrString|SetAttrString|CallMethod\(|HasAttrString", source)


def test_the_objects_named_have_what_the_core_reads():
    buf = EventBuffer([])
    tracer = TorchTracer(buf)
    t = torch.ones(2)
    for protocol, obj in ((ccore.CoreTracer, tracer), (ccore.CoreBuffer, buf), (ccore.CoreStacks, tracer.stacks),
                          (ccore.CorePlan, rules.OpPlan(torch.ops.aten.add.Tensor)),
                          (ccore.CoreIndexValues, IndexValues()), (ccore.CoreGpuTrace, GpuTrace),
                          (ccore.CoreTensor, t)):
        missing = {n for n in ccore.members(protocol) if not hasattr(obj, n)}
        assert not missing, (protocol.__name__, missing)
    assert hasattr(t.untyped_storage(), "nbytes")


def test_configure_takes_what_the_tracer_passes(source):
    (kwlist,) = re.findall(r"static PyObject \*configure\(.*?kwlist\[\] = \{(.*?)NULL\}", source, re.S)
    assert re.findall(r'"(\w+)"', kwlist) == list(ccore.configuration())


def test_the_constants_are_the_python_ones():
    c = ccore.configuration()
    assert (c["op"], c["alloc"], c["free"], c["user_kind"]) == (E.OP, E.ALLOC, E.FREE, stacks.USER)
    assert c["plan_kinds"] == {"untouched": rules.FAST_UNTOUCHED, "allocating": rules.FAST_ALLOCATING,
                               "accesses": rules.FAST_ACCESSES}
    assert rules.FAST_NONE not in c["plan_kinds"].values()
    assert len(set(c["callback_kinds"].values())) == 3


def test_the_core_names_the_fields_the_layouts_place(source):
    in_c = {name: re.findall(r'"(\w+)"', fields)
            for name, fields in re.findall(r"static const char \*const (\w+)_FIELDS\[\] = \{(.*?)NULL\}", source)}
    layouts = ccore.configuration()["layouts"]
    assert {k.lower(): set(v) for k, v in in_c.items()} == {k: set(v) for k, v in layouts.items()}
    for layout in layouts.values():
        assert sorted(layout.values()) == list(range(len(layout)))


def laid(layout, tup) -> dict:
    return {field: tup[at] for field, at in layout.items()}


def test_the_event_layouts_are_the_events_own():
    assert laid(ccore.OP_EVENT, E.op("a", "n", ["r"], ["w"], "s", "c", "f")) == {
        "kind": E.OP, "agent": "a", "name": "n", "reads": ("r",), "writes": ("w",), "stack": "s", "ctx": "c",
        "flags": "f"}
    assert laid(ccore.ALLOC_EVENT, E.alloc("sp", "st", "sz", "a", "s", "c", "w", pool=5)) == {
        "kind": E.ALLOC, "space": "sp", "start": "st", "size": "sz", "agent": "a", "stack": "s", "ctx": "c",
        "what": "w"}
    assert laid(ccore.FREE_EVENT, E.free("sp", "st", "s")) == {"kind": E.FREE, "space": "sp", "start": "st",
                                                               "stack": "s"}
    for make, kind in ((E.event_record, E.EVENT_RECORD), (E.event_wait, E.EVENT_WAIT)):
        assert laid(ccore.STREAM_EVENT, make("e", "a", "s")) == {"kind": kind, "event": "e", "agent": "a",
                                                                 "stack": "s"}


def test_the_plan_layouts_are_the_plans_own():
    plan = rules.OpPlan(torch.ops.aten.add_.Tensor)
    assert laid(rules.FAST_FIELDS, plan.fast) == {
        "kind": rules.FAST_ACCESSES, "call": plan.call, "name": plan.name, "tensor_args": plan.tensor_args,
        "fresh_outputs": plan.fresh_outputs, "is_copy": plan.is_copy}
    assert [laid(rules.ARG_FIELDS, a) for a in plan.tensor_args] == [
        {"position": 0, "name": "self", "is_write": True, "is_list": False},
        {"position": 1, "name": "other", "is_write": False, "is_list": False}]


def test_the_current_op_layout_is_the_dispatchs_own(monkeypatch):
    from streamsan.tracers.torch import device

    monkeypatch.setattr(device, "raw_stream", lambda dev: 0x1000)
    tracer = TorchTracer(EventBuffer([]))
    seen = []
    out, agent, evs, _ = placement.run_inside(tracer, lambda: seen.append(tracer.op_agent), (), {}, 0, 9)
    assert laid(placement.OP_FIELDS, seen[0]) == {"device": 0, "agent": agent, "stack": 9, "ctx": 0,
                                                  "thread": threading.get_ident(), "events": evs}


def test_the_core_accepts_the_configuration_and_refuses_another():
    try:
        from streamsan import _ctracer
    except ImportError:
        pytest.skip("the C core is not built")
    if not getattr(_ctracer, "AVAILABLE", 0):
        pytest.skip("the C core is not built")
    good = ccore.configuration()
    _ctracer.configure(**good)
    bad = dict(good, layouts=dict(good["layouts"], op={**ccore.OP_EVENT, "extra": 8}))
    with pytest.raises(ValueError, match="layout op"):
        _ctracer.configure(**bad)
    _ctracer.configure(**good)
