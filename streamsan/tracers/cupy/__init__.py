"""The CuPy tracer (docs/cupy.md): :mod:`.tracer` is the tracer itself, :mod:`.patches` the CuPy surfaces it
replaces while it runs (one module each), :mod:`.annotations` ``streamsan.cupy_access``, :mod:`.analyses` what a
traced call reads and writes, :mod:`.ranges` the byte ranges of arrays and pointers, :mod:`.placement` where its
events go. Importing any of them imports neither CuPy nor torch."""
