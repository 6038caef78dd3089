"""Configuration: defaults, [tool.streamsan] in the nearest pyproject.toml, STREAMSAN_* variables, the command
line, in that order of strength; the TOML subset reader for Python 3.10; `wrap --help`."""

from __future__ import annotations

import json

import pytest

from streamsan import exitcodes
from streamsan.cli import main
from streamsan.config import OPTIONS, ConfigError, find_pyproject, read_pyproject, resolve
from tests.support import report_scenarios as S
from tests.support.report_kit import write_trace

KEYS = tuple(OPTIONS)
DEFAULTS = {"report": "streamsan-report.json", "trace": None, "scope": "full", "fail_on_race": False,
            "suppressions": None, "format": "text", "output": None, "allow_incomplete": False}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty project directory (cwd) with a subdirectory, and no STREAMSAN_* variables."""
    for o in OPTIONS.values():
        monkeypatch.delenv(o.env, raising=False)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    return tmp_path


def test_every_option_and_its_default():
    assert {k: o.default for k, o in OPTIONS.items()} == DEFAULTS
    assert [o.env for o in OPTIONS.values()] == ["STREAMSAN_REPORT", "STREAMSAN_TRACE", "STREAMSAN_SCOPE",
                                                 "STREAMSAN_FAIL_ON_RACE", "STREAMSAN_SUPPRESSIONS",
                                                 "STREAMSAN_FORMAT", "STREAMSAN_OUTPUT", "STREAMSAN_ALLOW_INCOMPLETE"]


def test_defaults_without_pyproject_or_environment(project):
    assert resolve({}, KEYS, environ={}) == DEFAULTS


def test_precedence_command_line_over_environment_over_pyproject(project):
    (project / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.streamsan]\nformat = "markdown"\nscope = "hooks"\nfail_on_race = true\n'
        'report = "reports/r.json"  # relative to this file\nsuppressions = \'streamsan.supp\'\n\n[tool.other]\n'
        'format = "ignored"\n')
    env = {"STREAMSAN_FORMAT": "json", "STREAMSAN_FAIL_ON_RACE": "0", "STREAMSAN_TRACE": ""}
    got = resolve({"format": "sarif", "trace": None}, KEYS, environ=env)
    assert got == {"report": str(project / "reports/r.json"), "trace": None, "scope": "hooks",
                   "fail_on_race": False, "suppressions": str(project / "streamsan.supp"), "format": "sarif",
                   "output": None, "allow_incomplete": False}
    assert resolve({}, ("format",), environ=env) == {"format": "json"}
    assert resolve({}, ("format",), environ={}) == {"format": "markdown"}


def test_the_nearest_pyproject_wins_even_without_a_streamsan_table(project):
    (project / "pyproject.toml").write_text('[tool.streamsan]\nformat = "html"\n')
    assert find_pyproject(str(project / "sub")) == str(project / "pyproject.toml")
    assert resolve({}, ("format",), environ={}) == {"format": "html"}
    (project / "sub" / "pyproject.toml").write_text('[project]\nname = "inner"\n')
    assert find_pyproject(str(project / "sub")) == str(project / "sub" / "pyproject.toml")
    assert resolve({}, ("format",), environ={}) == {"format": "text"}


@pytest.mark.parametrize("env,message", [
    ({"STREAMSAN_FAIL_ON_RACE": "maybe"},
     "STREAMSAN_FAIL_ON_RACE: expected one of 1, true, yes, on, 0, false, no, off, got 'maybe'"),
    ({"STREAMSAN_SCOPE": "partial"}, "STREAMSAN_SCOPE: expected one of full, hooks, got 'partial'"),
    ({"STREAMSAN_FORMAT": "xml"},
     "STREAMSAN_FORMAT: expected one of text, markdown, json, sarif, html, perfetto, got 'xml'"),
])
def test_bad_environment_values(project, env, message):
    with pytest.raises(ConfigError) as e:
        resolve({}, KEYS, environ=env)
    assert str(e.value) == message


@pytest.mark.parametrize("table,message", [
    ("fail_on_race = 1", "[tool.streamsan] fail_on_race: expected true or false, got 1"),
    ('scope = "partial"', "[tool.streamsan] scope: expected one of full, hooks, got 'partial'"),
    ('report = ""', "[tool.streamsan] report: expected a non-empty string, got ''"),
    ('colour = "red"', "[tool.streamsan]: unknown key 'colour' (known: report, trace, scope, fail_on_race, "
                       "suppressions, format, output, allow_incomplete)"),
])
def test_bad_pyproject_values(project, table, message):
    path = project / "pyproject.toml"
    path.write_text(f"[tool.streamsan]\n{table}\n")
    with pytest.raises(ConfigError) as e:
        read_pyproject(str(path))
    assert str(e.value) == f"{path}: {message}"


def test_invalid_toml_is_one_line(project):
    path = project / "pyproject.toml"
    path.write_text("[tool.streamsan\nformat = \n")
    with pytest.raises(ConfigError) as e:
        read_pyproject(str(path))
    assert str(e.value).startswith(f"{path}: invalid TOML: ") and "\n" not in str(e.value)


def test_cli_reads_the_configuration(project, capsys):
    trace = write_trace(project / "t.sstrace", [S.pinned_d2h_then_h2d()])
    (project / "pyproject.toml").write_text('[tool.streamsan]\nformat = "json"\nfail_on_race = true\n')
    code = main(["replay", str(trace)])
    out, _ = capsys.readouterr()
    assert code == exitcodes.RACES and json.loads(out)["summary"]["races"] == 1
    code = main(["replay", str(trace), "--format", "text", "--no-fail-on-race"])
    out, _ = capsys.readouterr()
    assert code == 0 and out.startswith("streamsan: 1 race found, 1 occurrence ")


def test_cli_config_errors_are_one_line(project, capsys, monkeypatch):
    monkeypatch.setenv("STREAMSAN_FORMAT", "xml")
    code = main(["show", "r.json"])
    assert code == exitcodes.USAGE
    assert capsys.readouterr().err == ("streamsan: error: STREAMSAN_FORMAT: expected one of text, markdown, json, "
                                       "sarif, html, perfetto, got 'xml'\n")


def test_wrap_help_shows_every_option_with_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at the terminal's width, breaking at hyphens
    assert main(["wrap", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for o in OPTIONS.values():
        assert f"{o.flag}" in out
        assert f"(default: {o.default_text()}; env {o.env})" in out
    assert "--fail-on-race, --no-fail-on-race" in out
    assert ("options come from, strongest first: the command line; STREAMSAN_<KEY> environment variables "
            "(STREAMSAN_FAIL_ON_RACE=1); the [tool.streamsan] table of the nearest pyproject.toml "
            "(fail_on_race = true); the defaults shown.") in out
