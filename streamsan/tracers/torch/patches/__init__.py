"""The PyTorch surfaces the torch tracer patches, one module each: what a dispatch mode and PyTorch's GPU trace
callbacks do not show. Each module's ``install(tracer)`` patches its surface and returns the undo, which puts back
exactly what it replaced; the tracer installs :data:`SURFACES` in order when it starts and undoes them in reverse
when it stops. (Triton is patched once the program imports it: :mod:`.triton`.)
"""

from __future__ import annotations

from . import (backward, compile, empty_cache, graphs, host_reads, mem_pools, queries, record_stream,
               storage_resize, stream_creation, tensor_data)

SURFACES = (queries.install, host_reads.install, mem_pools.install, record_stream.install, storage_resize.install,
            backward.install, stream_creation.install, tensor_data.install, graphs.install, compile.install,
            empty_cache.install)
