"""streamsan's options: each one's default and help, and where its value comes from.

An option is set, strongest first: on the command line; in a ``STREAMSAN_<KEY>`` environment variable (an
empty one counts as unset); in the ``[tool.streamsan]`` table of the nearest ``pyproject.toml`` (searched from
the current directory upward; relative paths in it are relative to its directory); else its default.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from dataclasses import dataclass

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from .exitcodes import INCOMPLETE, NOTHING_CHECKED, RACES
from .report.formats import FORMATS

log = logging.getLogger("streamsan")

PRECEDENCE = ("options come from, strongest first: the command line; STREAMSAN_<KEY> environment variables\n"
              "(STREAMSAN_FAIL_ON_RACE=1); the [tool.streamsan] table of the nearest pyproject.toml\n"
              "(fail_on_race = true); the defaults shown")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(Exception):
    """A bad option value or configuration file; the message is one line."""


@dataclass(frozen=True)
class Option:
    key: str
    default: object
    help: str
    kind: str = "str"  # "str", "path" or "bool"
    choices: tuple = ()
    metavar: str | None = None

    @property
    def env(self) -> str:
        return "STREAMSAN_" + self.key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def default_text(self) -> str:
        if self.kind == "bool":
            return "true" if self.default else "false"
        return "none" if self.default is None else str(self.default)


OPTIONS = {o.key: o for o in (
    Option("report", "streamsan-report.json", "where to write the JSON report", "path", metavar="PATH"),
    Option("trace", None, "keep the trace file here (a directory if several processes wrote one)", "path",
           metavar="PATH"),
    Option("scope", "full", "trace every CUDA op (full) or only inside library hooks (hooks)",
           choices=("full", "hooks")),
    Option("fail_on_race", False, f"exit with {RACES} when any race was found (suppressed ones do not count)",
           "bool"),
    Option("suppressions", None, "a file of suppression rules (see docs/usage.md)", "path", metavar="FILE"),
    Option("format", "text", "how to print the report", choices=FORMATS),
    Option("output", None, "wrap: where the report goes in a --format other than text and markdown: a file, or - "
           "for standard output (default: the report's path with the format's extension)", "path",
           metavar="PATH"),
    Option("allow_incomplete", False, f"under --fail-on-race, pass a report without races that is incomplete "
           f"(else exit {INCOMPLETE}) or in which nothing was checked (else exit {NOTHING_CHECKED})", "bool"),
)}

# The STREAMSAN_* variables that are no option above, and what reads them.
OTHER_VARIABLES = {
    "STREAMSAN_CORE": "python: run the torch tracer without its C part; c: without the native dispatch lane",
    "STREAMSAN_GPU_TRACE": "python: let PyTorch's Python path carry its GPU-trace events, not the native observer",
    "STREAMSAN_SESSION_DIR": "set by streamsan wrap for the processes it runs",
    "STREAMSAN_RECORD_DIR": "the GPU tests: record each scenario's trace there",
    "STREAMSAN_TEST_ALLOCATOR": "the GPU tests: a CUDA allocator library to load",
}
CORE_VALUES = ("python", "c", "native")
GPU_TRACE_VALUES = ("python", "native")


def add_arguments(parser: argparse.ArgumentParser, keys) -> None:
    """Add the options ``keys`` to a parser, each with its default and environment variable in its help. Their
    parsed value is None unless given (see :func:`resolve`)."""
    for key in keys:
        o = OPTIONS[key]
        text = f"{o.help} (default: {o.default_text()}; env {o.env})"
        if o.kind == "bool":
            parser.add_argument(o.flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif o.choices:
            parser.add_argument(o.flag, choices=o.choices, default=None, help=text)
        else:
            parser.add_argument(o.flag, default=None, metavar=o.metavar, help=text)


def _check(o: Option, value, where: str):
    """``value`` (from a TOML file) if valid for ``o``, else ConfigError."""
    if o.kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    if o.choices and value not in o.choices:
        raise ConfigError(f"{where}: expected one of {', '.join(o.choices)}, got {value!r}")
    return value


def _from_env(o: Option, text: str):
    if o.kind != "bool":
        return _check(o, text, o.env)
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ConfigError(f"{o.env}: expected one of {', '.join(_TRUE + _FALSE)}, got {text!r}")


def environment_warnings(environ=None) -> list[str]:
    """One line for each ``STREAMSAN_*`` variable that streamsan ignores: a name it does not know (a misspelled
    option), or a ``STREAMSAN_CORE`` or ``STREAMSAN_GPU_TRACE`` it does not understand. Bad values of options are errors where they are
    used (:func:`resolve`)."""
    environ = os.environ if environ is None else environ
    known = [o.env for o in OPTIONS.values()] + list(OTHER_VARIABLES)
    out = []
    for name in sorted(environ):
        if not name.startswith("STREAMSAN_") or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}"
        out.append(f"streamsan: warning: unknown environment variable {name} ignored ({hint})")
    core = environ.get("STREAMSAN_CORE", "").strip().lower()
    if core and core not in CORE_VALUES:
        out.append(f"streamsan: warning: STREAMSAN_CORE={environ['STREAMSAN_CORE']!r} ignored (expected one of "
                   f"{', '.join(CORE_VALUES)}): the torch tracer runs with its C part (through the dispatch lane) where "
                   f"it was built")
    carrier = environ.get("STREAMSAN_GPU_TRACE", "").strip().lower()
    if carrier and carrier not in GPU_TRACE_VALUES:
        out.append(f"streamsan: warning: STREAMSAN_GPU_TRACE={environ['STREAMSAN_GPU_TRACE']!r} ignored (expected "
                   f"one of {', '.join(GPU_TRACE_VALUES)}): the native observer carries GPU-trace events where it "
                   f"loads")
    return out
    return out


def find_pyproject(start: str) -> str | None:
    """The nearest pyproject.toml in ``start`` or a directory above it."""
    d = os.path.abspath(start)
    while True:
        p = os.path.join(d, "pyproject.toml")
        if os.path.isfile(p):
            return p
        up = os.path.dirname(d)
        if up == d:
            return None
        d = up


def _table(text: str, path: str):
    try:
        return tomllib.loads(text).get("tool", {}).get("streamsan")
    except ValueError as e:  # tomllib.TOMLDecodeError is a ValueError
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def read_pyproject(path: str) -> dict:
    """The validated ``[tool.streamsan]`` table of a pyproject.toml (empty without one), paths made absolute."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    table = _table(text, path)
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.streamsan] is not a table")
    out = {}
    for key, value in table.items():
        o = OPTIONS.get(key)
        if o is None:
            raise ConfigError(f"{path}: [tool.streamsan]: unknown key {key!r} (known: {', '.join(OPTIONS)})")
        value = _check(o, value, f"{path}: [tool.streamsan] {key}")
        if o.kind == "path" and value != "-":
            value = os.path.join(os.path.dirname(path), os.path.expanduser(value))
        out[key] = value
    return out


def resolve(given: dict, keys, *, environ=None, cwd: str | None = None) -> dict:
    """The value of each option in ``keys``: ``given`` (command-line values, None = not given), else the
    environment, else the nearest pyproject.toml, else the default."""
    environ = os.environ if environ is None else environ
    path = find_pyproject(cwd or os.getcwd())
    in_file = read_pyproject(path) if path else {}
    values = {}
    for key in keys:
        o = OPTIONS[key]
        if given.get(key) is not None:
            values[key], source = given[key], "the command line"
        elif environ.get(o.env):
            values[key], source = _from_env(o, environ[o.env]), o.env
        elif key in in_file:
            values[key], source = in_file[key], path
        else:
            values[key], source = o.default, "the default"
        log.debug("option %s = %r from %s", key, values[key], source)
    return values
