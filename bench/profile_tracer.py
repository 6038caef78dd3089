"""Where the tracer's time goes: cProfile of the decode loop under streamsan (record or full mode).

    python bench/profile_tracer.py [--mode record|full] [--offload]
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
p.add_argument("--mode", default="record", choices=("record", "full"))
p.add_argument("--offload", action="store_true")
a = p.parse_args()
fn = decode_workload(qwen3(1024, 8, 8, 8, 128, 3072), 1, 512, 32, offloading=a.offload)
fn()
s = Session(trace_path=os.path.join(tempfile.mkdtemp(), "p.sstrace") if a.mode == "record" else None,
            analyze=a.mode == "full").start()
fn()
prof = cProfile.Profile()
prof.enable()
fn()
prof.disable()
s.stop()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
