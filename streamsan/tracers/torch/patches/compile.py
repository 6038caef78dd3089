"""``torch.compile``: compiled functions run eagerly under the dispatch mode (Dynamo does not compile under one),
their ops checked one by one; said once, and Dynamo is kept from compiling streamsan's own frames.
"""

from __future__ import annotations

import torch

from ..dispatch import dynamo_safe
from .attributes import Replaced

COMPILE_NOTE = ("torch.compile: compiled functions run eagerly while streamsan's dispatch mode is active (Dynamo "
                "does not compile under one), so their ops are checked one by one; the program's speed differs")


def install(tracer):
    """Patch ``torch.compile``; returns the undo."""
    replaced = Replaced()
    compile_fn = getattr(torch, "compile", None)
    if compile_fn is not None:
        def compile(*a, **k):
            tracer.note_once("compile", COMPILE_NOTE)
            dynamo_safe()
            return compile_fn(*a, **k)

        compile.__wrapped__ = compile_fn
        compile.__doc__ = compile_fn.__doc__
        torch.compile = compile
        replaced.add(torch, "compile", compile_fn)
    return replaced.undo
