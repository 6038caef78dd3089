"""The replay fixtures: traces recorded on a GPU by tests/gpu, one folder per suite under
``tests/replay/fixtures/``, each with its ``expected.json`` (trace name -> findings, as (kind, previous stream role,
previous op, current stream role, current op) lists) beside the traces."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "replay" / "fixtures"


def suites() -> list[str]:
    """Every suite's folder name, sorted."""
    return sorted(p.parent.name for p in FIXTURES.glob("*/expected.json"))


def expected(suite: str) -> dict:
    """A suite's expectations: trace name -> findings."""
    return json.loads((FIXTURES / suite / "expected.json").read_text())


def trace(key: str) -> Path:
    """The path of one recorded trace, by its key ``"<suite>/<name>"``."""
    suite, name = key.split("/")
    return FIXTURES / suite / f"{name}.sstrace"


def traces(suite: str) -> list[Path]:
    """A suite's recorded traces, sorted by name."""
    return sorted((FIXTURES / suite).glob("*.sstrace"))
