"""Render a sample HTML report (every finding kind, one with sync edges, one suppressed) and screenshot it in
headless Chromium (Debian's ``chromium`` package), to look at the page as a browser draws it.

    python -m tests.support.render_screenshot [OUT_DIR] [--height PX]      # from the repository root

writes OUT_DIR/report.html, OUT_DIR/session.html (the notebook fragment) and a PNG of each (default OUT_DIR:
./out/screenshot). Not a CI test: tests/report/test_render_formats.py runs it only where chromium is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from streamsan.replay import replay_trace
from streamsan.report.merge import merge_reports
from streamsan.report.render_html import render_html, render_session_html
from streamsan.suppressions import apply_suppressions, parse_suppressions
from streamsan.trace import TraceWriter
from tests.support import report_scenarios as S

SCENARIOS = (S.recorded_too_early, S.pinned_d2h_then_h2d, S.host_read_after_d2h, S.missing_record_stream,
             S.alloc_reuse)
RULES = "kind:alloc-reuse  # the side stream's fill is a known benign reuse in this sample\n"
ENV = {"streamsan": "0.1.0", "python": "3.11.7 (CPython)", "torch": "2.13.0", "cuda_runtime": "12.8",
       "nvidia_driver": "580.65.06", "gpus": ["NVIDIA H200"], "command": ["python", "run.py"]}


def sample_report() -> dict:
    """Each scenario replayed from its own trace (so with timelines), merged, the alloc-reuse one suppressed."""
    with tempfile.TemporaryDirectory() as d:
        reports = []
        for i, scenario in enumerate(SCENARIOS):
            path = os.path.join(d, f"trace-{i}.sstrace")
            w = TraceWriter(path, {"command": ["python", "run.py"]})
            w.write(scenario())
            w.close()
            reports.append(replay_trace(path))
    merged = merge_reports(reports, command=["python", "run.py"], environment=ENV)
    return apply_suppressions(merged, parse_suppressions(RULES, "streamsan.supp"))


def chromium() -> str | None:
    """The Chromium (or Chrome) executable, if one is installed."""
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def screenshot(html: Path, png: Path, width: int = 1200, height: int = 900) -> None:
    """Screenshot ``html`` with headless Chromium into ``png``; raises CalledProcessError or TimeoutExpired."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={width},{height}",
                        html.resolve().as_uri()], check=True, capture_output=True, timeout=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="out/screenshot")
    p.add_argument("--height", type=int, default=900)
    args = p.parse_args(argv)
    if chromium() is None:
        print("render_screenshot: chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = sample_report()
    for name, text in (("report", render_html(report)), ("session", render_session_html(report))):
        html = out / f"{name}.html"
        html.write_text(text if name == "report" else f"<!DOCTYPE html><meta charset=utf-8>{text}", encoding="utf-8")
        screenshot(html, out / f"{name}.png", height=args.height)
        print(out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
