"""Who carries PyTorch's GPU-trace events (``streamsan/tracers/torch/trace_slot.py``), on the CPU.

Each check runs in a process of its own: PyTorch's GPU-trace slot, once taken, is the process's for good. Events are
fired through the slot's interpreter as CUDA code fires them (the observer's ``fire_trace_event``), so the path from
the slot to streamsan's callbacks is the real one; only the CUDA code that would fire them is missing.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from streamsan.native import observer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (the repository)


@pytest.fixture(scope="module")
def native():
    module, reason = observer.load()
    if module is None:
        pytest.skip(reason)
    return module


def run_alone(code: str, **env) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **env)
    environ.pop("STREAMSAN_GPU_TRACE", None) if "STREAMSAN_GPU_TRACE" not in env else None
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                         env=environ)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


ACTIVATE_AS_IF_CUDA = """
    import json, torch
    from streamsan.tracers.torch import trace_slot
    from streamsan.report.environment import collect_environment
    torch.cuda.is_available = lambda: True
    {before}
    trace_slot.activate()
    print(json.dumps({{"carrier": trace_slot.describe(), "env": collect_environment()["gpu_trace"]}}))
"""


def test_without_cuda_pytorch_carries_them():
    got = run_alone("""
        import json, torch
        from streamsan.tracers.torch import trace_slot
        from streamsan.tracers.torch.callbacks import GpuTrace
        from streamsan.report.environment import collect_environment
        before = collect_environment()["gpu_trace"]
        GpuTrace.install()
        print(json.dumps({"before": before, "after": collect_environment()["gpu_trace"]}))
    """)
    assert got == {"before": None, "after": "python (no CUDA device)"}


def test_the_native_observer_carries_them_where_it_loads(native):
    got = run_alone(ACTIVATE_AS_IF_CUDA.format(before=""))
    assert got == {"carrier": "native", "env": "native"}


def test_streamsan_gpu_trace_python_keeps_pytorchs_path(native):
    got = run_alone(ACTIVATE_AS_IF_CUDA.format(before=""), STREAMSAN_GPU_TRACE="python")
    assert got == {"carrier": "python (STREAMSAN_GPU_TRACE=python)", "env": "python (STREAMSAN_GPU_TRACE=python)"}


def test_a_slot_taken_first_keeps_pytorchs_path(native):
    got = run_alone(ACTIVATE_AS_IF_CUDA.format(before="torch._C._activate_gpu_trace()  # (CSAN enabled first)"))
    assert got["carrier"] == "python (another interpreter owns PyTorch's GPU-trace slot)"


def test_every_kind_reaches_the_registries_in_order(native):
    """Through the native carrier: each kind of event reaches its registry's callbacks with its arguments, in the
    order fired; a callback registered later (CSAN enabling itself after streamsan) is fired too, after PyTorch's
    own interpreter is activated; a callback that raises does not stop the others or the program."""
    got = run_alone("""
        import json, torch
        import torch.cuda._gpu_trace as gt
        from streamsan.native import observer
        from streamsan.tracers.torch import trace_slot
        torch.cuda.is_available = lambda: True
        trace_slot.activate()
        m, _ = observer.load()
        seen = []
        for name in ("event_creation", "event_deletion", "event_record", "event_wait", "memory_allocation",
                     "memory_deallocation", "stream_creation", "device_synchronization", "stream_synchronization",
                     "event_synchronization"):
            getattr(gt, "register_callback_for_" + name)(lambda *a, name=name: seen.append([name, *a]))
        for kind, args in ((1, (11,)), (2, (12,)), (3, (13, 7)), (4, (14, 9)), (5, (4096,)), (6, (4096,)),
                           (7, (9,)), (8, ()), (9, (7,)), (10, (13,))):
            m.fire_trace_event(kind, *args)
        torch._C._activate_gpu_trace()  # a later user of PyTorch's path
        def boom(p):
            raise RuntimeError("a callback that fails")
        gt.register_callback_for_memory_allocation(boom)
        gt.register_callback_for_memory_allocation(lambda p: seen.append(["late", p]))
        m.fire_trace_event(5, 8192)
        print(json.dumps({"seen": seen, "carrier": trace_slot.describe()}))
    """)
    assert got["carrier"] == "native"
    assert got["seen"] == [["event_creation", 11], ["event_deletion", 12], ["event_record", 13, 7],
                           ["event_wait", 14, 9], ["memory_allocation", 4096], ["memory_deallocation", 4096],
                           ["stream_creation", 9], ["device_synchronization"], ["stream_synchronization", 7],
                           ["event_synchronization", 13], ["memory_allocation", 8192], ["late", 8192]]



def test_with_no_tracer_and_no_other_callback_nothing_is_forwarded(native):
    """Once the tracer is detached (its session ended), the native carrier forwards no event while no one else's
    callback is registered: the program runs on without the callbacks' cost. A tracer attached again, or a callback
    of someone else's (CSAN, a profiler) registered, and the events reach the registries again."""
    got = run_alone("""
        import json, torch
        import torch.cuda._gpu_trace as gt
        from streamsan.native import observer
        from streamsan.tracers.torch import trace_slot
        from streamsan.tracers.torch.callbacks import GpuTrace
        torch.cuda.is_available = lambda: True
        GpuTrace.install()
        m, _ = observer.load()
        reached, others = [], []
        gt.MemoryAllocationCallbacks.fire_callbacks = lambda *a: reached.append(a[0])  # (looked up per event)
        steps = []
        def step(name, ptr):
            m.fire_trace_event(5, ptr)
            steps.append([name, list(reached), list(others)])
        step("fresh", 1)
        GpuTrace.detach()
        step("detached", 2)
        GpuTrace.attach(object())
        step("attached", 3)
        GpuTrace.detach()
        step("detached again", 4)
        gt.register_callback_for_memory_allocation(lambda p: others.append(p))
        step("someone else's callback", 5)
        GpuTrace.detach()
        step("detached with it there", 6)
        print(json.dumps({"carrier": trace_slot.describe(), "steps": steps}))
    """)
    assert got["carrier"] == "native"
    assert got["steps"] == [["fresh", [1], []], ["detached", [1], []], ["attached", [1, 3], []],
                            ["detached again", [1, 3], []], ["someone else's callback", [1, 3], [5]],
                            ["detached with it there", [1, 3], [5, 6]]]


STANDIN_PROGRAM = """
    import json, sys, torch
    from tests.support.standin import StandIn, CURRENT_STREAM, fire, through_slot
    from streamsan.tracers.torch.callbacks import GpuTrace
    carrier = sys.argv[1]
    if carrier != "registry":
        why = through_slot(carrier)
        assert not why, why
    got, kept = [], []
    with StandIn(consumer=got.extend, keep=kept) as standin:
        mode = standin.enter(sys.argv[2])
        try:
            for step in range(3):
                x = torch.randn(8, 16)
                y = (x * 2).relu()
                CURRENT_STREAM[0] = 9  # a side stream waits for the default one, copies, and is waited for
                fire("record", 1000 + step, 7)
                fire("wait", 1000 + step, 9)
                z = y.clone()
                CURRENT_STREAM[0] = 7
                fire("record", 2000 + step, 9)
                fire("wait", 2000 + step, 7)
                kept += [x, y, z, (z @ y.t()).sum()]
        finally:
            mode.__exit__(None, None, None)
            mode.tracer.buffer.flush()
            GpuTrace.active = None
    names = {}
    def canon(v):  # pointers renamed by first appearance; the rest as it is
        if isinstance(v, int) and v > 1 << 20:
            return "p%d" % names.setdefault(v, len(names))
        if isinstance(v, (tuple, list)):
            return [canon(i) for i in v]
        return v
    print(json.dumps([canon(list(ev)) for ev in got]))
"""


@pytest.mark.parametrize("core", ["trace", "trace-python"])
def test_the_tracer_sees_the_same_events_whoever_carries_them(native, core):
    """The stand-in's program (ops, allocations and frees, event records and waits across two streams), traced with
    its events fired straight into the registries, through the native carrier and through PyTorch's own: the
    tracer's events are the same."""
    def events(carrier):
        environ = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        environ.pop("STREAMSAN_GPU_TRACE", None)
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(STANDIN_PROGRAM), carrier, core],
                             capture_output=True, text=True, timeout=300, env=environ)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    direct, native_carried, python_carried = events("registry"), events("native"), events("python")
    kinds = {ev[0] for ev in direct}
    from streamsan import events as E
    assert {E.OP, E.ALLOC, E.FREE, E.EVENT_RECORD, E.EVENT_WAIT} <= kinds
    assert native_carried == direct
    assert python_carried == direct


def test_a_callback_registered_before_or_on_any_registry_keeps_the_events_forwarded(native):
    """Someone else's callback registered before streamsan's (a stream-creation callback, on a registry where
    streamsan has none), or later on such a registry: the native carrier keeps forwarding after detach()."""
    got = run_alone("""
        import json, torch
        import torch.cuda._gpu_trace as gt
        from streamsan.native import observer
        from streamsan.tracers.torch.callbacks import GpuTrace
        torch.cuda.is_available = lambda: True
        first, later = [], []
        gt.register_callback_for_stream_creation(lambda s: first.append(s))
        GpuTrace.install()
        m, _ = observer.load()
        GpuTrace.detach()
        m.fire_trace_event(7, 21)
        print(json.dumps({"first": first}))
    """)
    assert got["first"] == [21]
    got = run_alone("""
        import json, torch
        import torch.cuda._gpu_trace as gt
        from streamsan.native import observer
        from streamsan.tracers.torch.callbacks import GpuTrace
        torch.cuda.is_available = lambda: True
        later = []
        GpuTrace.install()
        m, _ = observer.load()
        GpuTrace.detach()
        m.fire_trace_event(7, 21)
        gt.register_callback_for_stream_creation(lambda s: later.append(s))
        m.fire_trace_event(7, 22)
        GpuTrace.detach()
        m.fire_trace_event(7, 23)
        print(json.dumps({"later": later}))
    """)
    assert got["later"] == [22, 23]
