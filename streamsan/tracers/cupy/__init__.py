"""The CuPy tracer (docs/cupy.md). :mod:`.tracer` is the tracer itself; :mod:`.patches` holds the CuPy surfaces it
replaces while it runs, one module each, made of :mod:`.patching` (replacing and restoring attributes) and
:mod:`.wrappers` (traced functions, methods, transparent subclasses), routed through :mod:`.active` (the running
tracer). :mod:`.analyses` says what a traced call reads and writes, from the byte ranges of :mod:`.ranges` and the
raw-kernel declarations of :mod:`.annotations` (``streamsan.cupy_access``); :mod:`.placement` puts a traced
call's op among the events fired inside it. Importing any of them imports neither CuPy nor torch.
"""
