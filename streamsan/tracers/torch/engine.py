"""PyTorch's autograd engine as the torch tracer sees it: the stacks of backward ops run in the engine's own threads
(no Python frames there), and the ``record_stream`` the engine does in C++ for gradients its consumers read on
other streams.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

from ... import events as E
from ...analysis.locations import ENGINE_FRAME
from . import device
from .tensors import plain_tensors

_STRIDED = torch.strided
_get_ident = threading.get_ident
current_autograd_node = getattr(torch._C, "_current_autograd_node", None)
ENGINE_CALLBACK = "callback at the end of backward"


def engine_stack(tracer, events) -> int:
    """The stack of an op run by PyTorch's autograd engine in a thread without Python frames: the backward
    node it runs, then where ``backward()`` was called. In an engine thread between nodes, the op is a callback
    queued for the end of the backward pass (DDP's reducer copying reduced buckets into ``.grad``): named so."""
    node = current_autograd_node() if current_autograd_node is not None else None
    site = tracer.backward_site
    if node is None:
        if not site or _get_ident() not in tracer.engine_threads:
            return 0
        return tracer.stacks.synthetic(events, ("autograd", ENGINE_CALLBACK, site),
                                       ((ENGINE_FRAME, 0, ENGINE_CALLBACK),) + site)
    tracer.engine_threads.add(_get_ident())
    name = node.name()
    sid = tracer.stacks.synthetic(events, ("autograd", name, site), ((ENGINE_FRAME, 0, name),) + site)
    tracer.engine_stacks.add(sid)
    return sid


def engine_op(tracer, evs, plan, args, kwargs, out, a, stack) -> None:
    """An op in a thread of PyTorch's autograd engine. The engine hands the gradients a backward node makes
    to the nodes that consume them, and when a consumer runs on another stream it records the gradient on that
    stream, in C++ (``record_stream``, unseen by a dispatch mode). Gradients are what the engine's own
    backward formulas make (ops without Python frames: not the tensors pack / unpack hooks or the forward
    pass made), so: the outputs of such ops are remembered as gradients, and each gradient read by an op of a
    backward node (a formula, or a custom ``autograd.Function``'s ``backward``) is recorded on that op's stream.
    Ops of hooks (``Tensor.register_hook``, post-accumulate-grad hooks) are not the node's: a hook that reads a
    gradient on a stream of its own gets no record from the engine (pipeline stages' boundary copies, FSDP-like
    gradient reduction), so a free of that gradient without ``record_stream`` is the program's to answer for."""
    grads = tracer.engine_grads
    own = stack in tracer.engine_stacks
    if plan.fresh_outputs and own:
        for t in plain_tensors(out):
            if getattr(t, device.ATTR):
                grads.add(t.untyped_storage().data_ptr())
    if not grads:
        return
    node = None  # (whether the op is a node's: known at the first gradient it reads)
    nargs = len(args)
    for pos, name, is_write, _is_list in plan.tensor_args:
        if is_write:
            continue
        for t in plain_tensors(args[pos] if 0 <= pos < nargs else kwargs.get(name)):
            if getattr(t, device.ATTR) and t.layout is _STRIDED:
                base = t.untyped_storage().data_ptr()
                if base in grads:
                    if node is None:
                        node = own or in_custom_backward()
                    if node:
                        evs.append((E.RECORD_STREAM, t.get_device() + device.OFFSET, base, a, stack))


def in_custom_backward() -> bool:
    """Whether a Python caller runs inside a custom ``autograd.Function``'s backward (the engine calls it through
    ``BackwardCFunction.apply`` in torch/autograd/function.py), rather than in a hook the engine calls directly."""
    f = sys._getframe(1)  # (an engine thread may hold no Python frame below the tracer's own)
    while f is not None:
        code = f.f_code
        if code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_PY):
            return True
        f = f.f_back
    return False


_FUNCTION_PY = os.path.join("torch", "autograd", "function.py")
