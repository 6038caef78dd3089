"""Where the tracer's time goes: cProfile of the decode loop under streamsan (record or full mode).

    python bench/profile_tracer.py [--mode record|full|hooks] [--offload] [--big] [--steps N]
"""

import argparse
import cProfile
import os
import pstats
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import decode_workload, qwen3  # noqa: E402

from streamsan.session import Session  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--mode", default="record", choices=("record", "full", "hooks"))
p.add_argument("--offload", action="store_true")
p.add_argument("--big", action="store_true", help="the 6.5B model at batch 8 after a 2048-token prompt")
p.add_argument("--steps", type=int, default=32)
p.add_argument("--top", type=int, default=25)
a = p.parse_args()
if a.big:
    fn = decode_workload(qwen3(4096, 32, 32, 8, 128, 11008), 8, 2048, a.steps, offloading=a.offload)
else:
    fn = decode_workload(qwen3(1024, 8, 8, 8, 128, 3072), 1, 512, a.steps, offloading=a.offload)
fn()
s = Session(scope="hooks" if a.mode == "hooks" else "full",
            trace_path=os.path.join(tempfile.mkdtemp(), "p.sstrace") if a.mode == "record" else None,
            analyze=a.mode != "record").start()
fn()
prof = cProfile.Profile()
prof.enable()
fn()
prof.disable()
s.stop()
pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
