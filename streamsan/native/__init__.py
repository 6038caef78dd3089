"""streamsan's native observer: the ops a ``TorchDispatchMode`` would see and PyTorch's GPU-trace events, recorded
in C++ (``observer.cpp``) without a Python call per op.

``build`` compiles it against the installed torch at first use (cached per torch version, CPython ABI and source
hash; ``(None, reason)`` where it cannot be had); ``observer`` is its Python API (start, stop, arm a thread, drain,
the GPU-trace slot); ``records`` decodes what is drained, without torch. The same extension holds the dispatch lane
(``lane.cpp``: the torch tracer's dispatch mode without PyTorch's Python dispatch; its Python side is
``streamsan.tracers.torch.lane``); ``interpreter.h`` is the PyInterpreter both build on.
"""
