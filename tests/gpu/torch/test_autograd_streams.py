"""Backward passes and streams on a GPU, each with the exact findings streamsan must report (or none).

PyTorch runs each backward op on the stream its forward op ran on, orders a backward op after the ops that
produced its inputs (events on the streams involved), and at the end orders the caller's current stream after
the streams that wrote leaf gradients. What a program does around ``backward()`` is its own business: the cases
below follow "Stream semantics of backward passes" in PyTorch's CUDA notes, whose safe and unsafe examples are
exactly what users write. Same table-driven style as test_torch_scenarios.py.
"""

import torch

import streamsan
from tests.gpu.support.scenario_kit import scenario_tests

N = 1 << 16


def side():
    s = torch.cuda.Stream()
    streamsan.name_stream(s, "side")
    return s


def leaf():
    return torch.full((N,), 0.5, device="cuda", requires_grad=True)


def forward_on(s, x):
    """loss = sum(x * x * 3), computed on stream s (after s has waited for x)."""
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        return (x * x * 3).sum()


def side_forward():
    """(side stream, leaf, loss computed from the leaf on the side stream)."""
    s = side()
    x = leaf()
    return s, x, forward_on(s, x)


# ------------------------------------------------------------------------------------------ clean
def training_step_one_stream():
    """Forward, backward, optimizer step and zero_grad on the default stream: the common case."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(2):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()


def grads_used_in_backward_stream_context():
    """Safe (the notes' first example): grads are used in the same stream context as backward()."""
    s, x, loss = side_forward()
    with torch.cuda.stream(s):
        loss.backward()
        y = x.grad * 2
    torch.cuda.synchronize()
    del y


def grads_used_after_wait_stream():
    """Safe with synchronization: the current stream waits for the backward stream before using grads."""
    s, x, loss = side_forward()
    with torch.cuda.stream(s):
        loss.backward()
    torch.cuda.current_stream().wait_stream(s)
    y = x.grad * 2
    torch.cuda.synchronize()
    del y


def backward_from_default_after_side_forward():
    """Safe: backward() called on the default stream; PyTorch orders the default stream after the side stream's
    backward ops that wrote the leaf's gradient."""
    s, x, loss = side_forward()
    loss.backward()
    y = x.grad * 2
    torch.cuda.synchronize()
    del y


def initial_grad_in_same_context():
    """Safe: the initial gradient is made in the stream context of backward()."""
    s, x, loss = side_forward()
    with torch.cuda.stream(s):
        loss.backward(gradient=torch.ones_like(loss))
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def initial_grad_synchronized():
    """Safe: the initial gradient is made on the default stream, and the backward stream waits for it
    (and it is recorded on that stream, so its memory is not reused early)."""
    s, x, loss = side_forward()
    initial = torch.ones_like(loss)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        initial.record_stream(s)
        loss.backward(gradient=initial)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def grad_hook_waits_for_backward_stream():
    """Safe: a gradient hook hands the gradient to a side stream after making it wait."""
    s = side()
    x = leaf()
    out = {}

    def hook(g):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out["g"] = g * 2
        return None

    x.register_hook(hook)
    (x * 3).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ races
def grads_used_outside_backward_stream_context():
    """Unsafe (the notes' second example): forward and backward ran on the side stream; the default stream
    reads the gradient without waiting for it."""
    s, x, loss = side_forward()
    with torch.cuda.stream(s):
        loss.backward()
    y = x.grad * 2
    torch.cuda.synchronize()
    del y


def initial_grad_from_other_stream():
    """Unsafe (the notes' example): the initial gradient is filled on the default stream and backward() reads it
    on the side stream with no synchronization."""
    s, x, loss = side_forward()
    initial = torch.ones_like(loss)
    with torch.cuda.stream(s):
        loss.backward(gradient=initial)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def grad_hook_reads_on_side_stream():
    """A gradient hook launches work on a side stream that reads the gradient without waiting for the backward
    op that wrote it (DDP-style communication hooks that forget to wait)."""
    s = side()
    x = leaf()
    out = {}

    def hook(g):
        with torch.cuda.stream(s):
            out["g"] = g * 2
        return None

    x.register_hook(hook)
    (x * 3).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def _hook_reads_gradient_on_side_stream(record):
    """A pipeline stage's boundary hook: the gradient of h is read on a side stream (its "send"), after the side
    stream waited for the backward; the engine then hands the gradient on to h's own backward node and frees it.
    The engine records gradients only on the stream of the node that consumes them, never on a hook's stream:
    without ``record_stream`` the allocator may give the block to the default stream's next allocation while the
    side stream still reads it (pytorch/pytorch#33909)."""
    s = side()
    x = leaf()
    out = {}

    def hook(g):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(1_000_000)
            out["sent"] = g * 2
        if record:
            g.record_stream(s)
        return None

    h = x * 3
    h.register_hook(hook)
    (h * h).sum().backward()
    out["next"] = x.grad + 1  # the default stream's next allocation, which may get the gradient's block
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def grad_hook_side_read_then_freed():
    _hook_reads_gradient_on_side_stream(record=False)


def grad_hook_side_read_recorded():
    _hook_reads_gradient_on_side_stream(record=True)


SCENARIOS = [
    training_step_one_stream, grads_used_in_backward_stream_context, grads_used_after_wait_stream,
    backward_from_default_after_side_forward, initial_grad_in_same_context, initial_grad_synchronized,
    grad_hook_waits_for_backward_stream, grads_used_outside_backward_stream_context,
    initial_grad_from_other_stream, grad_hook_reads_on_side_stream, grad_hook_side_read_then_freed,
    grad_hook_side_read_recorded,
]

EXPECTED = {
    "training_step_one_stream": [],
    "grads_used_in_backward_stream_context": [],
    "grads_used_after_wait_stream": [],
    "backward_from_default_after_side_forward": [],
    "initial_grad_in_same_context": [],
    "initial_grad_synchronized": [],
    "grad_hook_waits_for_backward_stream": [],
    "grads_used_outside_backward_stream_context": [
        ("device-device", "side", "aten::add.Tensor", "default", "aten::mul.Tensor"),
    ],
    "initial_grad_from_other_stream": [
        ("device-device", "default", "aten::ones_like", "side", "aten::mul.Tensor"),
    ],
    "grad_hook_reads_on_side_stream": [
        ("device-device", "default", "aten::mul.Tensor", "side", "aten::mul.Tensor"),
    ],
    "grad_hook_side_read_then_freed": [
        ("missing-record-stream", "side", "aten::mul.Tensor", "default", "allocation"),
    ],
    "grad_hook_side_read_recorded": [],
}


test_every_scenario_has_an_expectation, test_scenario = scenario_tests(SCENARIOS, EXPECTED)
