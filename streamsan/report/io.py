"""Reading and writing report files, with one-line errors for the user (:class:`ReportError`)."""

from __future__ import annotations

import json
import os

from .build import SCHEMA

REQUIRED = ("schema", "command", "environment", "summary", "races")


class ReportError(Exception):
    """A report file that cannot be read or written; the message is one line for the user."""


def load_report(path: str) -> dict:
    """Read a report and check that it is a ``streamsan.report/1`` report (top-level shape only)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ReportError(f"{path}: no such report file") from None
    except IsADirectoryError:
        raise ReportError(f"{path}: is a directory, not a report file") from None
    except OSError as e:
        raise ReportError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError):
        raise ReportError(f"{path}: not a streamsan report (not JSON)") from None
    if not isinstance(data, dict) or "schema" not in data:
        raise ReportError(f"{path}: not a streamsan report (no \"schema\" key)")
    if data["schema"] != SCHEMA:
        raise ReportError(f"{path}: report schema {data['schema']!r} is not supported (this streamsan reads "
                          f"{SCHEMA})")
    missing = [k for k in REQUIRED if k not in data]
    if missing or not isinstance(data["races"], list) or not isinstance(data["summary"], dict):
        what = f"missing {', '.join(missing)}" if missing else "races or summary of the wrong type"
        raise ReportError(f"{path}: malformed report ({what})")
    return data


def check_writable(path: str, directory_ok: bool = False) -> None:
    """Fail early, before a long run, if an output file (or, ``directory_ok``, a directory of files) could not
    be written at ``path``."""
    if os.path.isdir(path):
        if not directory_ok:
            raise ReportError(f"cannot write {path}: is a directory")
        if not os.access(path, os.W_OK):
            raise ReportError(f"cannot write into {path}: permission denied")
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ReportError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ReportError(f"cannot write {path}: permission denied")


def write_report(report: dict, path: str) -> None:
    """Write a report as indented JSON."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise ReportError(f"cannot write {path}: {e.strerror}") from None
