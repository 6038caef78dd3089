"""Stack keys: the op's call site and the next user frames outside it; library frames between them are walked,
not keyed; the first stack seen for a key is recorded (DEF_STACK) with file, line and function."""

from streamsan import events as E
from streamsan.stacks import StackTable

LIB = "/venv/lib/python3.12/site-packages/torch/nn/fake_module.py"  # a library file, as findings classify them
_lib = {}
exec(compile("def call_impl(f, *a):\n    return f(*a)\n\ndef wrapped(f, *a):\n    return call_impl(f, *a)\n",
             LIB, "exec"), _lib)


def op(table, events):
    """Stands for the tracer: the op's stack, its own frame skipped."""
    return table.capture(events, 1)


def site(table, events):  # the innermost user frame: the op's call site
    return op(table, events)


def caller_a(table, events):
    return site(table, events)


def caller_b(table, events):
    return site(table, events)


def via_library(table, events, depth):  # one call site, reaching `site` through 1 or 2 torch wrappers
    chain = (site, table, events) if depth == 1 else (_lib["wrapped"], site, table, events)
    return _lib["wrapped"](*chain)


def test_the_next_user_frame_is_part_of_the_key():
    t, evs = StackTable(), []
    a, b = caller_a(t, evs), caller_b(t, evs)
    assert a != b and caller_a(t, evs) == a
    assert [ev[0] for ev in evs] == [E.DEF_STACK, E.DEF_STACK]  # one record per key


def test_library_frames_between_user_frames_are_not_keyed():
    t, evs = StackTable(), []
    once = via_library(t, evs, 1)
    assert via_library(t, evs, 2) == once  # the same user frames, more torch frames between
    (_, sid, frames), = evs
    assert sid == once
    assert [f[2] for f in frames[:4]] == ["site", "call_impl", "wrapped", "via_library"]
    assert frames[0][0] == __file__ and frames[1][0] == LIB


def test_outer_callers_beyond_the_key_share_the_first_record():
    t, evs = StackTable(key_users=1), []
    a, b = caller_a(t, evs), caller_b(t, evs)
    assert a == b and len(evs) == 1
    assert [f[2] for f in evs[0][2][:2]] == ["site", "caller_a"]


def test_an_own_frame_is_skipped():
    t, evs = StackTable(), []

    def tracer_frame(table, events):  # as if it were streamsan's: classified OWN
        return table.capture(events, 0)

    t.classify(tracer_frame.__code__)
    t.kinds[id(tracer_frame.__code__)] = 0
    sid = tracer_frame(t, evs)
    assert evs[0][1] == sid and evs[0][2][0][2] == "test_an_own_frame_is_skipped"


def test_a_thread_without_frames_gets_the_fallback_stack():
    """PyTorch's autograd engine runs CUDA backward ops in C++ threads: no Python frame outside streamsan."""
    t, evs = StackTable(), []
    assert t.capture(evs, 10_000) == 0 and evs == []  # no fallback: no stack
    t.fallback = lambda events: t.synthetic(events, ("autograd", "MulBackward0"),
                                            (("<autograd engine>", 0, "MulBackward0"),))
    sid = t.capture(evs, 10_000)
    assert t.capture(evs, 10_000) == sid
    assert evs == [(E.DEF_STACK, sid, (("<autograd engine>", 0, "MulBackward0"),))]


def test_frames_here_leaves_out_nothing_of_the_user():
    frames = StackTable().frames_here(0)
    assert frames[0][2] == "test_frames_here_leaves_out_nothing_of_the_user"
    assert StackTable().frames_here(10_000) == ()


def test_a_backward_op_is_located_by_its_node_and_the_backward_call():
    from streamsan.analysis.locations import ENGINE_FRAME, location

    frames = ((ENGINE_FRAME, 0, "MulBackward0"),
              ("/venv/lib/python3.12/site-packages/torch/_tensor.py", 623, "Tensor.backward"),
              ("/home/me/train.py", 42, "step"))
    assert location(frames, "") == "MulBackward0 (backward() at home/me/train.py:42)"
    assert location(frames[:1], "") == "MulBackward0 (backward)"



def calls_patched_torch(table, events):
    import torch

    return torch.index_select(op, table, events)


def test_a_torch_function_replaced_by_another_library_is_plumbing(tmp_path, monkeypatch):
    """torch_geometric replaces ``torch.index_select`` with a function of its own when it is imported: that frame
    is left out of the stack, so the finding stands where torch.index_select was called (not in the wrapper that
    every call shares, which would merge them); the key still tells call sites apart. Another function of that
    library stays what it is."""
    import sys

    import torch

    from streamsan.analysis.locations import location

    lib = tmp_path / "site-packages" / "fakegeo"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(
        "import torch\n\n"
        "def _new_index_select(f, *a):\n    return f(*a)\n\n"
        "def helper(f, *a):\n    return f(*a)\n\n"
        "torch.index_select = _new_index_select\n")
    monkeypatch.setattr(torch, "index_select", torch.index_select)  # (put back afterwards)
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    monkeypatch.delitem(sys.modules, "fakegeo", raising=False)
    import fakegeo

    t, evs = StackTable(), []
    a = calls_patched_torch(t, evs)
    b = caller_a(t, evs)
    assert a != b
    frames = evs[0][2]
    assert frames[0][2] == "calls_patched_torch" and all("fakegeo" not in f[0] for f in frames)
    assert location(frames, "?").endswith(f"test_stacks.py:{calls_patched_torch.__code__.co_firstlineno + 3}")
    fakegeo.helper(op, t, evs)
    assert evs[-1][2][0][2] == "helper" and "fakegeo" in evs[-1][2][0][0]


def test_a_wrapper_of_a_wrapper_is_plumbing_too(tmp_path, monkeypatch):
    """A second library wraps the first's ``torch.index_select`` (functools.wraps: ``__wrapped__``); the first keeps
    torch's own under ``_old_index_select``. Both wrappers' frames are left out, in a table made before the second
    library was imported too."""
    import sys

    import torch

    site = tmp_path / "site-packages"
    for lib, text in (("libone", "import torch\n\n_old_index_select = torch.index_select\n\n"
                                 "def _new_index_select(f, *a):\n    return f(*a)\n\n"
                                 "torch.index_select = _new_index_select\n"),
                      ("libtwo", "import functools\nimport torch\n\n_prev = torch.index_select\n\n"
                                 "@functools.wraps(_prev)\ndef index_select(f, *a):\n    return _prev(f, *a)\n\n"
                                 "torch.index_select = index_select\n")):
        (site / lib).mkdir(parents=True)
        (site / lib / "__init__.py").write_text(text)
        monkeypatch.delitem(sys.modules, lib, raising=False)
    monkeypatch.setattr(torch, "index_select", torch.index_select)  # (put back afterwards)
    monkeypatch.syspath_prepend(str(site))
    import libone  # noqa: F401

    early = StackTable()
    early_events = []
    calls_patched_torch(early, early_events)
    import libtwo  # noqa: F401

    t, evs = StackTable(), []
    calls_patched_torch(t, evs)
    calls_patched_torch(early, early_events)
    assert len(evs) == 1 and len(early_events) == 2
    for _, _, frames in evs + early_events:
        assert frames[0][2] == "calls_patched_torch"
        assert not [f for f in frames if "libone" in f[0] or "libtwo" in f[0]]
