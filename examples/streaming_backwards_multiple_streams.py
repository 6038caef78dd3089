"""A module whose forward pass runs on two streams of its own, called from a third: the structure of PyTorch's own
``test_streaming_backwards_multiple_streams`` (test/test_cuda.py).

``forward`` clones its input on the caller's stream, multiplies the clone by 2 on ``stream0`` and the input by 3 on
``stream1``, makes ``stream1`` wait for ``stream0`` and returns ``y0 + y1`` computed on ``stream1``. The caller, on
its own stream, calls ``.sum()`` on that result and ``backward()``. Nothing makes the caller's stream wait for
``stream1`` before ``.sum()`` reads ``y0 + y1``: the autograd engine synchronizes the streams of the backward pass,
not the forward pass, whose stream semantics are those of any other CUDA work. And the clone, made on the caller's
stream and read on ``stream0``, is freed when ``forward`` returns with no ``record_stream``: the caller's next
allocation (``.sum()``'s result) may take its block while ``stream0`` still reads it.

``--delay CYCLES`` holds ``stream1`` back (``torch.cuda._sleep``) before it adds: ``.sum()`` then reads the sum
before it is written, and the loss differs from 5 * x.sum(). Without the delay the race is rarely visible. The
test's own assertions are on the gradients, which do not depend on the loss's value: they pass either way.

Run it under streamsan: ``streamsan wrap -- python examples/streaming_backwards_multiple_streams.py``.
"""

from __future__ import annotations

import argparse

import torch


class StreamModel(torch.nn.Module):
    def __init__(self, delay: int = 0):
        super().__init__()
        self.delay = delay
        self.event = torch.cuda.Event()
        self.stream0 = torch.cuda.Stream()
        self.stream1 = torch.cuda.Stream()

    def forward(self, x):
        x0 = x.clone()  # on the caller's stream
        self.stream0.wait_stream(torch.cuda.current_stream())
        self.stream1.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream0):
            y0 = x0 * 2
            self.event.record(stream=torch.cuda.current_stream())
        with torch.cuda.stream(self.stream1):
            y1 = x * 3
            self.stream1.wait_event(self.event)
            if self.delay:
                torch.cuda._sleep(self.delay)
            return y0 + y1


def run(delay: int = 0, steps: int = 3, n: int = 1 << 20):
    """(loss, expected loss) of each step, and whether every gradient came out right."""
    caller = torch.cuda.Stream()
    out = []
    grads_ok = True
    with torch.cuda.stream(caller):
        model = StreamModel(delay)
        for _ in range(steps):
            x = torch.rand(n, device="cuda", requires_grad=True)
            loss = model(x).sum()
            loss.backward()
            out.append((loss.item(), 5 * x.detach().sum().item()))
            grads_ok &= bool(torch.equal(x.grad, torch.full_like(x, 5.0)))
    torch.cuda.synchronize()
    return out, grads_ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay", type=int, default=0, help="GPU cycles stream1 sleeps before it adds (0: none)")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    losses, grads_ok = run(a.delay, a.steps)
    for i, (loss, expected) in enumerate(losses):
        print(f"step {i}: loss {loss:.6g}, 5 * x.sum() {expected:.6g}, "
              f"{'same' if abs(loss - expected) <= 1e-3 * abs(expected) else 'DIFFERENT'}")
    print(f"gradients {'right' if grads_ok else 'WRONG'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
