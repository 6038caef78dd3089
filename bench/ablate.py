"""Where streamsan's time above the floor goes, by ablation, on the decode loop (GPU).

    python bench/ablate.py [--offload] [--runs 5]

Modes, interleaved over ``--runs`` rounds (each mode's best run; medians on stderr): ``plain``; ``floor`` (a no-op
dispatch mode, as cheap as streamsan's own); ``trace`` (the tracer feeding no consumer); ``nostack`` (the same with
stack capture replaced by a constant: what stacks cost); ``record`` (into a trace file); ``inline`` (in-process
analysis); ``full`` (analysis in the helper process). ``--profile`` adds a cProfile of one ``trace`` run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from bench import decode_workload, qwen3  # noqa: E402
from streamsan.session import Session  # noqa: E402
from support.standin import NoOp  # noqa: E402  (a no-op dispatch mode as cheap as streamsan's own)


def session(mode, tmp):
    if mode == "floor":
        m = NoOp()
        m.__enter__()
        return lambda: m.__exit__(None, None, None)
    if mode in ("trace", "nostack"):
        s = Session(analyze=False)
    elif mode == "record":
        s = Session(analyze=False, trace_path=os.path.join(tmp, f"a{time.time_ns()}.sstrace"))
    elif mode == "inline":
        s = Session()
    elif mode == "full":
        s = Session(helper=True)
    else:
        return lambda: None
    if mode == "nostack":
        s.stacks.capture = lambda events, skip=1: 0
    s.start()
    return s.stop


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--offload", action="store_true")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--modes", default="plain,floor,trace,nostack,record,inline,full")
    a = p.parse_args()
    fn = decode_workload(qwen3(1024, 8, 8, 8, 128, 3072), 1, 512, 32, offloading=a.offload)
    tmp = tempfile.mkdtemp()
    modes = a.modes.split(",")
    times = {m: [] for m in modes}
    for r in range(a.runs + 1):
        for m in modes:
            stop = session(m, tmp)
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                t = time.perf_counter() - t0
                stop()
            if r:
                times[m].append(t)
    plain = min(times["plain"])
    floor = min(times.get("floor") or [plain])
    print(f"decode{' offload' if a.offload else ''}: {'mode':8s} {'best s':>8s} {'median':>8s} {'x plain':>8s} "
          f"{'x floor':>8s}")
    for m, v in times.items():
        print(f"{'':15s} {m:8s} {min(v):8.3f} {statistics.median(v):8.3f} {min(v) / plain:8.2f} {min(v) / floor:8.2f}")

if __name__ == "__main__":
    main()
