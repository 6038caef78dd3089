"""Small programs run under each CUDA allocator configuration by test_allocator_backends.py, in a child process
(PYTORCH_CUDA_ALLOC_CONF is read once, when CUDA starts; ``STREAMSAN_TEST_ALLOCATOR``: a shared library whose
``ss_alloc`` / ``ss_free`` become PyTorch's CUDA allocator): four of tests/gpu/torch/test_torch_scenarios.py's
and one of its own. Prints one JSON line: the allocator backend, the torch tracer's notes, and per program the
(kind, previous op, current op) of each finding and the ALLOC / FREE events the session saw."""

import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # (the repository root: run as a script)

import torch  # noqa: E402

import streamsan  # noqa: E402
from streamsan import events as E  # noqa: E402
from tests.gpu.torch.test_torch_scenarios import (alloc_reuse_on_other_stream, missing_record_stream,  # noqa: E402
                                                  record_stream_right, write_default_then_side_write)

BIG = (5 << 18) + 1024


def churn_across_streams():
    """Clean: each stream allocates, uses and frees its own tensors; none crosses streams."""
    s = torch.cuda.Stream()
    for _ in range(20):
        x = torch.empty(BIG, device="cuda")
        x.fill_(1.0)
        y = x * 2
        del x, y
        with torch.cuda.stream(s):
            z = torch.empty(BIG, device="cuda")
            z.fill_(2.0)
            w = z + 1
            del z, w
    torch.cuda.synchronize()


PROGRAMS = (churn_across_streams, missing_record_stream, record_stream_right, write_default_then_side_write,
            alloc_reuse_on_other_stream)


def main():
    so = os.environ.get("STREAMSAN_TEST_ALLOCATOR")
    if so:  # a program's own allocator (stream_ordered_alloc.c), in place before CUDA starts
        torch.cuda.memory.change_current_allocator(
            torch.cuda.memory.CUDAPluggableAllocator(so, "ss_alloc", "ss_free"))
    out = {"programs": {}}
    for prog in PROGRAMS:
        kinds = collections.Counter()
        torch.cuda.synchronize()
        s = streamsan.watch()
        s.start()
        s.buffer.consumers.append(lambda evs: kinds.update(e[0] for e in evs))
        prog()
        s.stop()
        out["programs"][prog.__name__] = {
            "findings": [[f.kind, f.previous.name, f.current.name] for f in s.findings],
            "allocs": kinds[E.ALLOC], "frees": kinds[E.FREE]}
        out["notes"] = sorted(set(out.get("notes", [])) | {n for n in s.problems if "reports no allocations" in n})
    out["backend"] = torch.cuda.get_allocator_backend()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
