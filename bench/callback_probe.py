"""What PyTorch's GPU trace callbacks cost by themselves, with no tracer behind them (one process, in order):
plain twice (the drift between rounds), trace activated with no Python callback, with an empty Python callback,
with streamsan's inactive callbacks. Decode loop of bench.py and a per-call ``x + y``.

    python bench/callback_probe.py [--offload]
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import decode_workload, qwen3  # noqa: E402

fn = decode_workload(qwen3(1024, 8, 8, 8, 128, 3072), 1, 512, 32, offloading="--offload" in sys.argv)
x = torch.ones(256, device="cuda")
y = torch.ones(256, device="cuda")


def measure(label):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        x + y
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / n * 1e6
    print(f"{label:34s} decode median {statistics.median(ts):.3f}s min {min(ts):.3f}s   x+y {per:6.2f} us", flush=True)


a = torch.randn(8192, 8192, device="cuda")
for _ in range(50):
    a @ a  # clocks up
torch.cuda.synchronize()
measure("plain")
measure("plain again")
import torch.cuda._gpu_trace as gt  # noqa: E402

torch._C._activate_gpu_trace()
measure("trace on, no Python callback")

gt.register_callback_for_memory_allocation(lambda p: None)
gt.register_callback_for_memory_deallocation(lambda p: None)
measure("trace on, empty callbacks")
from streamsan.tracers.torch.callbacks import GpuTrace  # noqa: E402

GpuTrace.install()
measure("+ streamsan's (inactive)")
measure("plain-with-all again")
