"""Suppressions, as ThreadSanitizer users know them: a file of rules that move known findings out of a report's
``races`` into its ``suppressed`` list (counted in the summary, never dropped).

One rule a line, each with a reason after ``#``; blank lines and lines starting with ``#`` are comments::

    fingerprint:3f2a9c0d1e2b4a5c   # known upstream bug, transformers#48947
    frame:*/site-packages/accelerate/*   # glob over FILE:LINE or the function of any frame of either access
    kind:host-device               # reason
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from .analysis.findings import KINDS
from .report.build import summarize

log = logging.getLogger("streamsan")

TYPES = ("fingerprint", "frame", "kind")


class SuppressionError(Exception):
    """A bad suppression file; the message is one line, ``FILE:LINE: ...``."""


@dataclass(frozen=True)
class Rule:
    type: str
    pattern: str
    reason: str
    file: str
    line: int

    @property
    def text(self) -> str:
        return f"{self.type}:{self.pattern}"

    def matches(self, race: dict) -> bool:
        if self.type == "fingerprint":
            return race["fingerprint"] == self.pattern
        if self.type == "kind":
            return race["kind"] == self.pattern
        for access in (race["access"], race["previous_access"]):
            for f in access.get("stack_full") or access.get("stack") or []:
                if fnmatchcase(f"{f['file']}:{f['line']}", self.pattern) or fnmatchcase(f["function"], self.pattern):
                    return True
        return False


def _rule(text: str, file: str, line: int) -> Rule:
    body, hash_, reason = text.partition("#")
    body, reason = body.strip(), reason.strip()
    where = f"{file}:{line}"
    if not hash_ or not reason:
        raise SuppressionError(f"{where}: a rule needs a reason: add '# why' after {body!r}")
    kind, colon, pattern = body.partition(":")
    kind, pattern = kind.strip(), pattern.strip()
    if not colon or kind not in TYPES:
        raise SuppressionError(f"{where}: unknown rule {body!r} (rules start with fingerprint:, frame: or kind:)")
    if not pattern:
        raise SuppressionError(f"{where}: {kind}: needs a value")
    if kind == "fingerprint" and not re.fullmatch(r"[0-9a-f]+", pattern):
        raise SuppressionError(f"{where}: fingerprint {pattern!r} is not lowercase hex")
    if kind == "kind" and pattern not in KINDS:
        raise SuppressionError(f"{where}: unknown kind {pattern!r} (kinds: {', '.join(KINDS)})")
    return Rule(kind, pattern, reason, file, line)


def parse_suppressions(text: str, file: str) -> list:
    """The rules in a suppression file's text; ``file`` names it in errors."""
    rules = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line and not line.startswith("#"):
            rules.append(_rule(line, file, n))
    return rules


def load_suppressions(path: str) -> list:
    """The rules of the suppression file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SuppressionError(f"{path}: no such suppression file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SuppressionError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    rules = parse_suppressions(text, path)
    log.debug("%d suppression rules from %s", len(rules), path)
    return rules


def first_match(rules, race: dict):
    """The first rule (in file order) that matches a race item, or None."""
    return next((r for r in rules if r.matches(race)), None)


def apply_suppressions(report: dict, rules) -> dict:
    """A copy of the report whose races matched by a rule are moved to ``suppressed``, each with a
    ``suppression`` (the rule, its reason, file and line); the summary counts both."""
    kept, suppressed = [], list(report.get("suppressed", []))
    for race in report["races"]:
        rule = first_match(rules, race)
        if rule is None:
            kept.append(race)
            continue
        log.debug("suppressed %s %s by %s (%s:%d)", race["kind"], race["fingerprint"], rule.text, rule.file,
                  rule.line)
        suppressed.append(dict(race, suppression={"rule": rule.text, "reason": rule.reason, "file": rule.file,
                                                  "line": rule.line}))
    s = report["summary"]
    out = dict(report, races=kept, suppressed=suppressed)
    out["summary"] = summarize(kept, s, processes=s.get("processes"), suppressed=len(suppressed))
    return out
