"""What the watched program pays for analysis: in its own process, or in the helper process (streamsan.helper).

    python bench/helper_bench.py [--events 300000] [--work-us 4]

Feeds a synthetic decode-loop trace (bench/synth.py) through a session's event buffer in batches, as the
tracers do, with ``--work-us`` of busy host work per event standing for the program and the tracer (a traced
decode step makes about 2.5 events per op at 30-50 us per op on an H200 host). Times the producing thread while
events are produced (``during``) and at stop (``stop``: the rest of the analysis and, for the helper, sending
the analyzer back), against the same run without analysis. Runs without torch or a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from synth import decode_trace  # noqa: E402

from streamsan.session import Session  # noqa: E402


def run(events: list, analysis: str, work_s: float) -> tuple[float, float, int]:
    s = Session(analyze=analysis != "none", helper=analysis == "helper", echo=False)
    s.start()
    buf = s.buffer
    clock = time.perf_counter
    t0 = clock()
    for ev in events:
        end = clock() + work_s
        while clock() < end:
            pass
        buf.events.append(ev)
        if len(buf.events) >= buf.batch:
            buf.flush()
    t1 = time.perf_counter()
    s.stop()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(s.findings)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=300_000)
    p.add_argument("--work-us", type=float, default=4.0)
    a = p.parse_args()
    events = list(decode_trace(a.events))
    print(f"{len(events)} events, batches of 512, {a.work_us} us of work per event, {os.cpu_count()} CPUs")
    print(f"{'analysis':9s} {'during s':>9s} {'stop s':>7s} {'x none':>7s} {'findings':>8s}")
    base = None
    for name in ("none", "inline", "helper") * 2:
        during, stop, n = run(events, name, a.work_us * 1e-6)
        if name == "none":
            base = during
        print(f"{name:9s} {during:9.3f} {stop:7.3f} {(during + stop) / base:7.2f} {n:8d}")


if __name__ == "__main__":
    main()
