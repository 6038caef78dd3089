"""``wrap --format json|html|sarif|perfetto``: the summary stays on stderr (text) and the machine format goes
to a file (the report's path with the format's ending, or ``--output``), or to stdout with ``--output -``;
never to stderr. Text and Markdown are printed on stderr, as the summary."""

from __future__ import annotations

import json

import pytest
from tests.support.wrap_kit import child, run  # noqa: F401



SUMMARY = "streamsan: 1 race found, 2 occurrences (1 device-device; "


@pytest.mark.parametrize("fmt,path,start", [
    ("html", "streamsan-report.html", "<!DOCTYPE html>"),
    ("sarif", "streamsan-report.sarif", "{"),
    ("perfetto", "streamsan-report.perfetto.json", "{"),
])
def test_a_machine_format_goes_to_a_file_beside_the_report(capfd, child, tmp_path, fmt, path, start):
    code, out, err = run(capfd, "wrap", "--format", fmt, "--", *child, "race", 0)
    assert code == 0 and out == ""
    assert err.startswith(SUMMARY) and "<" not in err and "{" not in err
    assert err.splitlines()[-2:] == ["streamsan: report written to streamsan-report.json",
                                     f"streamsan: {fmt} report written to {path}"]
    assert (tmp_path / path).read_text().startswith(start)


def test_json_is_the_report_file_itself(capfd, child, tmp_path):
    code, out, err = run(capfd, "wrap", "--format", "json", "--report", "r.json", "--", *child, "race", 0)
    assert code == 0 and out == "" and err.startswith(SUMMARY) and "{" not in err
    assert err.splitlines()[-1] == "streamsan: report written to r.json"
    assert json.loads((tmp_path / "r.json").read_text())["schema"] == "streamsan.report/1"


def test_output_dash_is_stdout(capfd, child):
    code, out, err = run(capfd, "wrap", "--format", "json", "--output", "-", "--", *child, "race", 0)
    assert code == 0 and json.loads(out)["summary"]["races"] == 1 and err.startswith(SUMMARY)


def test_output_names_the_file(capfd, child, tmp_path):
    code, _, err = run(capfd, "wrap", "--format", "sarif", "--output", "out/scan.sarif", "--", *child, "race", 0)
    assert code == 0 and "streamsan: sarif report written to out/scan.sarif" in err
    assert json.loads((tmp_path / "out" / "scan.sarif").read_text())["version"] == "2.1.0"


def test_an_unwritable_output_is_one_warning(capfd, child):
    code, _, err = run(capfd, "wrap", "--format", "html", "--output", "/dev/full", "--", *child, "race", 4)
    assert code == 4
    assert err.splitlines()[-1] == "streamsan: warning: cannot write /dev/full: No space left on device"
