"""Reading and writing report files, with one-line errors for the user (:class:`ReportError`)."""

from __future__ import annotations

import json
import os
import re

from ..inputs import open_input
from .build import SCHEMA

REQUIRED = ("schema", "command", "environment", "summary", "races")
_SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema.json")
_schema_doc: dict | None = None


class ReportError(Exception):
    """A report file that cannot be read or written; the message is one line for the user."""


def load_report(path: str) -> dict:
    """Read a report and check that it is a ``streamsan.report/1`` report (top-level shape only)."""
    f = open_input(path, "report", ReportError, encoding="utf-8")
    try:
        with f:
            data = json.load(f)
    except OSError as e:
        raise ReportError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError):
        raise ReportError(f"{path}: not a streamsan report (not JSON)") from None
    except RecursionError:
        raise ReportError(f"{path}: not a streamsan report (JSON nested too deeply)") from None
    if not isinstance(data, dict) or "schema" not in data:
        raise ReportError(f"{path}: not a streamsan report (no \"schema\" key)")
    if data["schema"] != SCHEMA:
        raise ReportError(f"{path}: report schema {data['schema']!r} is not supported (this streamsan reads "
                          f"{SCHEMA})")
    missing = [k for k in REQUIRED if k not in data]
    if missing or not isinstance(data["races"], list) or not isinstance(data["summary"], dict):
        what = f"missing {', '.join(missing)}" if missing else "races or summary of the wrong type"
        raise ReportError(f"{path}: malformed report ({what})")
    problem = schema_problem(data)
    if problem:
        raise ReportError(f"{path}: malformed report ({problem})")
    return data


# ---------------------------------------------------------------------- schema.json, checked without jsonschema
_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, (list, tuple)),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) in (int, float),
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
}


def _type_name(v) -> str:
    return next((t for t in ("null", "boolean", "integer", "number", "string", "array", "object")
                 if _JSON_TYPES[t](v)), type(v).__name__)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def schema_problem(value, definition: str | None = None) -> str | None:
    """The first way ``value`` departs from ``schema.json`` (the whole report, or ``$defs/<definition>``), as
    one line naming where (``races[0].access.op: expected string, got integer``); None if it conforms. Checks
    the keywords schema.json uses, without the jsonschema package."""
    global _schema_doc
    if _schema_doc is None:
        with open(_SCHEMA_PATH, encoding="utf-8") as f:
            _schema_doc = json.load(f)
    root = _schema_doc
    return _check(value, root if definition is None else root["$defs"][definition], definition or "report", root)


def _check(v, s: dict, path: str, root: dict) -> str | None:
    ref = s.get("$ref")
    if ref is not None:
        p = _check(v, root["$defs"][ref.rsplit("/", 1)[1]], path, root)
        if p:
            return p
    t = s.get("type")
    if t is not None:
        types = (t,) if isinstance(t, str) else t
        if not any(_JSON_TYPES[x](v) for x in types):
            return f"{path}: expected {' or '.join(types)}, got {_type_name(v)}"
    if "const" in s and not _same(v, s["const"]):
        return f"{path}: expected {_short(s['const'])}, got {_short(v)}"
    if "enum" in s and not any(_same(v, e) for e in s["enum"]):
        return f"{path}: expected one of {', '.join(map(_short, s['enum']))}, got {_short(v)}"
    if "minimum" in s and type(v) in (int, float) and v < s["minimum"]:
        return f"{path}: {v} is less than {s['minimum']}"
    if "pattern" in s and isinstance(v, str) and not re.search(s["pattern"], v):
        return f"{path}: {_short(v)} does not match {s['pattern']}"
    if isinstance(v, dict):
        missing = [k for k in s.get("required", ()) if k not in v]
        if missing:
            return f"{path}: missing {', '.join(missing)}"
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for k, x in v.items():
            if k in props:
                p = _check(x, props[k], f"{path}.{k}", root)
            elif extra is False:
                return f"{path}: unexpected key {_short(k)}"
            elif isinstance(extra, dict):
                p = _check(x, extra, f"{path}.{k}", root)
            else:
                continue
            if p:
                return p
    if isinstance(v, (list, tuple)) and "items" in s:
        for i, x in enumerate(v):
            p = _check(x, s["items"], f"{path}[{i}]", root)
            if p:
                return p
    for sub in s.get("allOf", ()):
        p = _check(v, sub, path, root)
        if p:
            return p
    if "oneOf" in s:
        problems = [_check(v, sub, path, root) for sub in s["oneOf"]]
        matched = problems.count(None)
        if matched > 1:
            return f"{path}: ambiguous ({matched} forms match)"
        if matched == 0:  # name the problem inside the form of the value's type, if there is one
            return next((p for p in problems if not p.startswith(f"{path}: expected")), problems[0])
    return None


def prepare_output(path: str, directory_ok: bool = False) -> None:
    """Fail early, before a long run, if an output file (or, ``directory_ok``, a directory of files) could not
    be written at ``path``; creates the directories missing above it."""
    if not path:
        raise ReportError("an output path is empty (give a file name)")
    if os.path.isdir(path):
        if not directory_ok:
            raise ReportError(f"cannot write {path}: is a directory")
        if not os.access(path, os.W_OK):
            raise ReportError(f"cannot write into {path}: permission denied")
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        above = parent
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise ReportError(f"cannot write {path}: {above} is not a directory")
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise ReportError(f"cannot write {path}: cannot create directory {parent} ({e.strerror})") from None
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ReportError(f"cannot write {path}: permission denied")


def write_report(report: dict, path: str) -> None:
    """Write a report as indented JSON."""
    write_text(json.dumps(report, indent=2) + "\n", path)


def write_text(text: str, path: str) -> None:
    """Write a rendered report to a file; ReportError (one line) if that fails."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise ReportError(f"cannot write {path}: {e.strerror or e}") from None
