"""Streams a program creates while traced are named in reports after what the creating line assigns them to
(``streamsan.tracers.naming``), torch's and CuPy's: a finding says "on stream self.copy_stream" and its fix reads
``self.copy_stream.wait_stream(...)``. Streams made on one line (a list) are told apart as ``streams``,
``streams#2``; a name given with ``streamsan.name_stream`` wins."""

import pytest
import torch

import streamsan

N = 1 << 16


class Loader:
    def __init__(self):
        self.copy_stream = torch.cuda.Stream()


def _torch_program():
    loader = Loader()
    streams = [torch.cuda.Stream() for _ in range(2)]
    x = torch.empty(N, device="cuda")
    x.fill_(1.0)
    with torch.cuda.stream(loader.copy_stream):
        x.fill_(2.0)  # never waited for the default stream
    y = torch.empty(N, device="cuda")
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(streams[0]):
        y.fill_(3.0)
    with torch.cuda.stream(streams[1]):
        y.fill_(4.0)  # unordered with streams[0]
    torch.cuda.synchronize()


def test_torch_streams_are_named_after_their_assignment(san):
    session, got = san(_torch_program)
    assert got == [
        ("device-device", "default", "aten::fill_.Scalar", "self.copy_stream", "aten::fill_.Scalar"),
        ("device-device", "streams", "aten::fill_.Scalar", "streams#2", "aten::fill_.Scalar"),
    ]
    fixes = [r["fix"] for r in session.report()["races"]]
    assert fixes[0].startswith("Call `self.copy_stream.wait_stream(torch.cuda.current_stream())` before")
    assert "streams#2" in fixes[1]


def test_a_name_given_by_the_program_wins(san):
    def program():
        side = torch.cuda.Stream()
        streamsan.name_stream(side, "h2d")
        x = torch.empty(N, device="cuda")
        x.fill_(1.0)
        with torch.cuda.stream(side):
            x.fill_(2.0)
        torch.cuda.synchronize()

    session, got = san(program)
    assert got == [("device-device", "default", "aten::fill_.Scalar", "h2d", "aten::fill_.Scalar")]


def test_cupy_streams_are_named_after_their_assignment(san):
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("needs CuPy with a CUDA GPU")

    def program():
        transfer = cupy.cuda.Stream(non_blocking=True)
        x = cupy.empty(N, dtype=cupy.float32)
        x.fill(1)
        with transfer:
            x += 1  # never waited for the default stream's fill
        transfer.synchronize()

    session, got = san(program)
    assert got == [("device-device", "default", "cupy.ndarray.fill", "transfer", "cupy.ndarray.__iadd__")]
