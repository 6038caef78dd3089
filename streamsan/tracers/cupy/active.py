"""The running CuPy tracer, which every installed patch routes its calls through.

``tracer`` is set by :meth:`.tracer.CupyTracer.start` and cleared by its ``stop``; while it is None the patches
pass each call straight to CuPy.
"""

from __future__ import annotations

tracer = None
