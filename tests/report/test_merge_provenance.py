"""``streamsan merge`` says once what the reports share and per process what differs: a CPU report merged with
an H200 one does not claim either's environment, the command is the shared one, a report given twice counts
once, and a long command line is stored once."""

from __future__ import annotations

import json
import shutil
import sys

from streamsan.report.environment import environment_rows
from streamsan.report.merge import merge_reports
from tests.support import report_scenarios as S
from tests.support.report_kit import report_of
from tests.support.wrap_kit import child, run  # noqa: F401

CPU = {"streamsan": "0.1.0", "torch": "2.13.0+cpu", "gpus": [], "python": "3.11.7 (CPython)"}
H200 = {"streamsan": "0.1.0", "torch": "2.11.0+cu130", "gpus": ["NVIDIA H200"], "python": "3.11.7 (CPython)"}


def report(env: dict, command: list) -> dict:
    rep = report_of(S.pinned_d2h_then_h2d(2))
    rep["environment"], rep["command"] = dict(env), list(command)
    return rep


def test_environments_that_differ_are_kept_per_process():
    m = merge_reports([report(CPU, ["python", "a.py"]), report(H200, ["python", "b.py"])])
    assert m["environment"] == {"streamsan": "0.1.0", "python": "3.11.7 (CPython)"}
    assert [p["environment"] for p in m["processes"]] == [{"torch": "2.13.0+cpu", "gpus": []},
                                                          {"torch": "2.11.0+cu130", "gpus": ["NVIDIA H200"]}]
    assert m["command"] == [] and [p["command"] for p in m["processes"]] == [["python", "a.py"], ["python", "b.py"]]
    rows = dict(environment_rows(m))
    assert rows["torch"] == "varies by process: 2.13.0+cpu; 2.11.0+cu130"
    assert rows["command"] == "varies by process: python a.py; python b.py"


def test_reports_that_agree_say_it_once():
    m = merge_reports([report(H200, ["python", "a.py"]), report(H200, ["python", "a.py"])])
    assert m["environment"] == H200 and m["command"] == ["python", "a.py"]
    assert all("environment" not in p and "command" not in p for p in m["processes"])


def test_the_same_report_twice_is_merged_once(capfd, child, tmp_path):
    assert run(capfd, "wrap", "--report", "r.json", "--", *child, "race", 0)[0] == 0
    shutil.copy(tmp_path / "r.json", tmp_path / "copy.json")
    code, _, err = run(capfd, "merge", "r.json", "r.json", "copy.json", "-o", "m.json")
    assert code == 0
    assert err.splitlines() == ["streamsan: warning: r.json is the same report as r.json: merged once",
                                "streamsan: warning: copy.json is the same report as r.json: merged once",
                                "streamsan: merged 1 report (1 race) into m.json"]
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["races"][0]["count"] == 2 and len(m["processes"]) == 1


def test_a_long_command_line_is_stored_once(capfd, child, tmp_path):
    long_args = [c * 100_000 for c in "vwxyz"]  # (half a megabyte: one argument may have 128 KiB)
    (tmp_path / "prog.py").write_text("pass\n")  # (traced by the real bootstrap: its argv is wrap's command)
    assert run(capfd, "wrap", "--", sys.executable, "prog.py", *long_args)[0] == 0
    text = (tmp_path / "streamsan-report.json").read_text()
    assert [text.count(a) for a in long_args] == [1] * 5
    rep = json.loads(text)
    assert rep["command"][-5:] == long_args and "command" not in rep["environment"]
    assert "command" not in rep["processes"][0]
