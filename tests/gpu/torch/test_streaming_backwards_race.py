"""PyTorch's own ``test_streaming_backwards_multiple_streams`` (test/test_cuda.py) has two real races, which its
assertions (on the gradients) cannot see: examples/streaming_backwards_multiple_streams.py is a program of the same
structure, and docs/evaluation.md gives the PyTorch source that settles it. The caller's ``.sum()`` reads the
module's ``y0 + y1``, written on ``stream1``, without waiting for ``stream1`` (the autograd engine synchronizes the
backward pass, not the forward pass); and the clone of the input, made on the caller's stream and read on
``stream0``, is freed at the end of ``forward`` with no ``record_stream`` before the caller allocates again."""

import importlib.util
from pathlib import Path

import torch

import streamsan

_spec = importlib.util.spec_from_file_location(
    "streaming_backwards_multiple_streams",
    Path(__file__).resolve().parents[3] / "examples" / "streaming_backwards_multiple_streams.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_the_forward_streams_race_with_the_caller(san):
    def program():
        model = example.StreamModel()
        streamsan.name_stream(model.stream0, "stream0")
        streamsan.name_stream(model.stream1, "stream1")
        caller = torch.cuda.Stream()
        streamsan.name_stream(caller, "caller")
        with torch.cuda.stream(caller):
            for _ in range(2):
                x = torch.rand(1 << 16, device="cuda", requires_grad=True)
                model(x).sum().backward()
        torch.cuda.synchronize()

    _, got = san(program)
    assert got == [
        ("missing-record-stream", "stream0", "aten::mul.Tensor", "caller", "allocation"),
        ("device-device", "stream1", "aten::add.Tensor", "caller", "aten::sum"),
    ]


def test_the_gradients_are_right_whatever_the_loss():
    """What PyTorch's test asserts holds with the race exposed (a delay on stream1 before it adds)."""
    _, grads_ok = example.run(delay=50_000_000, steps=2, n=1 << 16)
    assert grads_ok
