"""``STREAMSAN_*`` variables that streamsan would ignore are each one warning line, wherever streamsan starts
(the command, an in-process session); ``-v`` works after the command too; bare ``streamsan`` prints its help."""

from __future__ import annotations

import pytest

import streamsan
from streamsan import session as SS
from streamsan.config import environment_warnings
from tests.support.wrap_kit import run

MISSPELLED = ("streamsan: warning: unknown environment variable STREAMSAN_REPROT ignored (did you mean "
              "STREAMSAN_REPORT?)")
BOGUS_CORE = ("streamsan: warning: STREAMSAN_CORE='bogus' ignored (expected one of python, c, native): the torch "
              "tracer runs with its C part (through the dispatch lane) where it was built")


def test_the_warnings():
    env = {"STREAMSAN_REPROT": "x", "STREAMSAN_CORE": "bogus", "STREAMSAN_FORMAT": "json", "OTHER": "1",
           "STREAMSAN_SESSION_DIR": "/tmp/s"}
    assert environment_warnings(env) == [MISSPELLED, BOGUS_CORE]
    assert environment_warnings({"STREAMSAN_CORE": "python", "STREAMSAN_CORE_X": "1"}) == [
        "streamsan: warning: unknown environment variable STREAMSAN_CORE_X ignored (did you mean STREAMSAN_CORE?)"]


def test_the_command_warns_once_per_variable(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STREAMSAN_REPROT", "r.json")
    monkeypatch.setenv("STREAMSAN_CORE", "bogus")
    code, out, err = run(capfd, "show", tmp_path / "missing.json")
    assert code == 2
    assert err.splitlines() == [MISSPELLED, BOGUS_CORE,
                                f"streamsan: error: {tmp_path / 'missing.json'}: no such report file"]


def test_an_in_process_session_warns_once(capfd, monkeypatch):
    monkeypatch.setattr(SS, "_said", set())
    monkeypatch.setenv("STREAMSAN_CORE", "bogus")
    for _ in range(2):
        with streamsan.watch(helper=False):
            pass
    assert capfd.readouterr().err.splitlines().count(BOGUS_CORE) == 1


@pytest.mark.parametrize("argv", [["-v", "show", "nope.json"], ["show", "-v", "nope.json"],
                                  ["show", "nope.json", "--verbose"]])
def test_verbose_before_or_after_the_command(capfd, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    import logging

    log = logging.getLogger("streamsan")
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(log, "level", log.level)
    code, _, err = run(capfd, *argv)
    assert code == 2 and "streamsan: debug: option format = 'text' from the default" in err


def test_bare_streamsan_prints_its_help(capfd):
    code, out, err = run(capfd)
    assert code == 0 and err == ""
    assert out.startswith("usage: streamsan [-h] [--version] [-v] COMMAND ...")
    assert "exit codes:" in out and "  130   streamsan was interrupted" in out
