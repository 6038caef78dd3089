"""Analyzer throughput (events/s) and peak memory on synthetic decode-loop traces.

    python bench/replay_bench.py                 # 10k, 100k, 1M events: write a trace, replay it, report
    python bench/replay_bench.py --sizes 10000000 --churn 4    # the 10M-event, heavy-churn memory run

Each size is analyzed in a fresh subprocess so peak RSS belongs to that run alone. Throughput is given per
wall-clock second and per CPU second of the one analyzing thread (the latter is what "on one core" means on a
loaded machine). Prints a table and, with --curve, the analyzer's memory every million events.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # (streamsan and the tests package of this checkout)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def one(n: int, churn: int, curve: bool) -> dict:
    from tests.support.synth import decode_trace

    from streamsan.analysis.analyzer import Analyzer
    from streamsan.trace import TraceReader, TraceWriter

    path = os.path.join(tempfile.mkdtemp(), "synth.sstrace")
    w = TraceWriter(path, {"command": ["synthetic"]})
    batch = []
    for ev in decode_trace(n, churn=churn):
        batch.append(ev)
        if len(batch) == 512:  # as the tracer writes
            w.write(batch)
            batch = []
    w.write(batch)
    w.close()
    size = os.path.getsize(path)
    base = _rss_mb()
    import gc
    gc.disable()  # as `streamsan replay` does: the analyzer's state has no garbage cycles to collect
    a = Analyzer()
    r = TraceReader(path)
    t0 = time.perf_counter()
    c0 = time.process_time()
    points = []
    nxt = 1_000_000
    for b in r.batches():
        a.feed(b)
        if curve and a.seq >= nxt:
            points.append((a.seq, round(_rss_mb() - base, 1), a.shadow_size()))
            nxt += 1_000_000
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    os.unlink(path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"events": a.seq, "seconds": round(dt, 3), "cpu_seconds": round(cpu, 3),
            "events_per_cpu_s": int(a.seq / cpu), "events_per_s": int(a.seq / dt), "trace_bytes": size,
            "peak_rss_mb": round(peak, 1), "analyzer_mb": round(_rss_mb() - base, 1), "shadow": a.shadow_size(),
            "findings": len(a.findings), "curve": points}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--churn", type=int, default=1)
    p.add_argument("--curve", action="store_true")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(one(a.child, a.churn, a.curve)))
        return
    print(f"{'events':>10} {'wall s':>8} {'events/s':>10} {'CPU s':>7} {'ev/CPU-s':>10} {'trace MB':>9} "
          f"{'peak RSS MB':>12} {'shadow':>7}")
    for n in map(int, a.sizes.split(",")):
        out = subprocess.run([sys.executable, __file__, "--child", str(n), "--churn", str(a.churn)]
                             + (["--curve"] if a.curve else []), capture_output=True, text=True, check=True)
        r = json.loads(out.stdout)
        print(f"{r['events']:>10} {r['seconds']:>8} {r['events_per_s']:>10} {r['cpu_seconds']:>7} "
              f"{r['events_per_cpu_s']:>10} {r['trace_bytes'] / 1e6:>9.1f} "
              f"{r['peak_rss_mb']:>12} {r['shadow']:>7}")
        for seq, mb, shadow in r["curve"]:
            print(f"    after {seq:>10} events: analyzer {mb:7.1f} MB, shadow ranges {shadow}")


if __name__ == "__main__":
    main()
