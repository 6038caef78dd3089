"""A traced program that hits a CUDA error (a device-side assert) still leaves a complete report, and its exit
status is propagated."""

import json
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import torch
    x = torch.zeros(4, device="cuda")
    y = x * 2
    idx = torch.tensor([7], device="cuda")
    z = x[idx]              # out of bounds: a device-side assert, reported at the next synchronization
    torch.cuda.synchronize()
""")


def test_cuda_error_leaves_a_report(tmp_path):
    prog = tmp_path / "boom.py"
    prog.write_text(PROGRAM)
    report = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "streamsan", "wrap", "--report", str(report), "--", sys.executable,
                        str(prog)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]  # the program's own exit status (an uncaught exception)
    assert "CUDA" in r.stderr and "Traceback" in r.stderr  # the program's error, shown as without streamsan
    rep = json.loads(report.read_text())
    assert rep["races"] == []
    assert rep["summary"]["ops"] >= 2
