"""What the table-driven GPU scenario modules share: named side streams, the two tests every such module has, the
summary of a session's findings they compare, and a one-process NCCL group."""

import os
import socket
from contextlib import contextmanager

import pytest
import torch

import streamsan


def streams(*names, make=None):
    """New streams (``make()``: a torch.cuda.Stream by default), each named for reports (the role in expected
    findings)."""
    out = []
    for n in names:
        s = make() if make is not None else torch.cuda.Stream()
        streamsan.name_stream(s, n)
        out.append(s)
    return out


def summarize(session):
    """(kind, previous role, previous op, current role, current op) of each finding, in order."""
    a = session.analyzer
    out = []
    for f in session.findings:
        out.append((f.kind, a.agents[f.previous.agent].name, f.previous.name, a.agents[f.current.agent].name,
                    f.current.name))
    return out


def need_cupy():
    """(cupy, cupyx) for a CuPy scenario module; skips the module without CuPy or without a GPU for it."""
    cupy = pytest.importorskip("cupy")
    cupyx = pytest.importorskip("cupyx")
    if not cupy.cuda.is_available():
        pytest.skip("needs CuPy with a CUDA GPU", allow_module_level=True)
    return cupy, cupyx


def cupy_streams(*names, non_blocking=True):
    """New CuPy streams (non-blocking unless told), each named for reports."""
    import cupy

    return streams(*names, make=lambda: cupy.cuda.Stream(non_blocking=non_blocking))


def cuda_malloc_async() -> bool:
    """Whether PyTorch's CUDA allocator is the cudaMallocAsync backend in this process."""
    return torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync"


def scenario_tests(scenarios, expected, known_false=None, tracer=None, under_async=None):
    """The tests of a scenario table: every scenario has an expectation, and each gives exactly its findings
    ((kind, previous role, previous op, current role, current op) tuples). ``known_false``: scenario name ->
    the false report it is known to give (a strict xfail). ``tracer``: a tracer the session must have run
    ("cupy"). ``under_async``: scenario name -> its findings under the cudaMallocAsync allocator where they are
    not the native allocator's, or why it cannot run there (test_allocator_backends.py runs the tables so)."""
    known_false = known_false or {}
    under_async = under_async or {}

    def test_every_scenario_has_an_expectation():
        assert sorted(f.__name__ for f in scenarios) == sorted(expected)

    @pytest.mark.parametrize("scenario", [
        pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=known_false[f.__name__]))
        if f.__name__ in known_false else f for f in scenarios], ids=lambda f: f.__name__)
    def test_scenario(san, scenario):
        want = expected[scenario.__name__]
        if scenario.__name__ in under_async and cuda_malloc_async():
            want = under_async[scenario.__name__]
            if isinstance(want, str):
                pytest.skip(want)
        session, got = san(scenario)
        if tracer is not None:
            assert tracer in session.tracers, session.problems
        assert got == [tuple(x) for x in want]

    return test_every_scenario_has_an_expectation, test_scenario


def untraced_then_traced(program):
    """(what the program returns untraced, what it returns under ``streamsan.watch()``, that session), the GPU
    idle before and after each run."""
    torch.cuda.synchronize()
    expected = program()
    torch.cuda.synchronize()
    with streamsan.watch() as session:
        got = program()
        torch.cuda.synchronize()
    return expected, got, session


def findings_of(session):
    """(kind, previous op, current op) of each finding: what an assertion about a clean run shows."""
    return [(f.kind, f.previous.name, f.current.name) for f in session.findings]


@contextmanager
def one_process_group():
    """A one-process NCCL group on GPU 0, its communicator and stream made before tracing starts."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(8, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    try:
        yield
    finally:
        dist.destroy_process_group()
