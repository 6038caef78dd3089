"""The findings of a racy program moved onto its fixed twin, for ``streamsan confirm --report``: each location
in the racy file becomes the line of the fixed file with the same source text (the nearest one to the original
line), so that the twin gets the same delays at the same call sites even where the fix shifted its lines."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from streamsan.analysis.locations import short_path


def _line_map(bug: Path, fixed: Path) -> dict:
    bug_lines = bug.read_text().splitlines()
    fixed_lines = [line.strip() for line in fixed.read_text().splitlines()]
    out = {}
    for n, text in enumerate(bug_lines, 1):
        text = text.strip()
        same = [i for i, t in enumerate(fixed_lines, 1) if t == text and text]
        if same:
            out[n] = min(same, key=lambda i: abs(i - n))
    return out


def transplant(report: dict, bug: Path, fixed: Path) -> tuple:
    """(the report with the racy file's locations moved to the fixed file, the locations that could not be)."""
    bug_name, fixed_name = short_path(str(bug)), short_path(str(fixed))
    lines = _line_map(bug, fixed)
    out, lost = copy.deepcopy(report), []
    for race in out["races"]:
        for key in ("previous_access", "access"):
            access = race[key]
            path, _, line = access["location"].rpartition(":")
            if path != bug_name:
                continue
            if int(line) in lines:
                access["location"] = f"{fixed_name}:{lines[int(line)]}"
            else:
                lost.append(access["location"])
    return out, lost


def transplant_file(report_path: Path, bug: Path, fixed: Path, dest: Path) -> list:
    report, lost = transplant(json.loads(report_path.read_text()), bug, fixed)
    dest.write_text(json.dumps(report))
    return lost
