"""What a report lets a reader conclude: races found, or none among what was checked, or nothing checked.

A report without races is a pass only if it is complete (every event analyzed) and something was checked (at
least one CUDA stream operation traced). Renderers headline a report by :func:`verdict`; ``--fail-on-race``
exits by it (:func:`fail_on_race_exit`).
"""

from __future__ import annotations

from ..exitcodes import INCOMPLETE, NOTHING_CHECKED, OK, RACES

RACES_FOUND, INCOMPLETE_REPORT, NOTHING_CHECKED_REPORT, PASSED = "races", "incomplete", "nothing-checked", "passed"


def nothing_checked(report: dict) -> bool:
    """No CUDA stream operation was traced (no GPU, or the program ran none): no race could have been found."""
    return report["summary"].get("ops", 0) == 0


def verdict(report: dict) -> str:
    """:data:`RACES_FOUND`, :data:`INCOMPLETE_REPORT`, :data:`NOTHING_CHECKED_REPORT` or :data:`PASSED`."""
    if report["races"]:
        return RACES_FOUND
    if not report.get("complete", True):
        return INCOMPLETE_REPORT
    if nothing_checked(report):
        return NOTHING_CHECKED_REPORT
    return PASSED


def headline(report: dict) -> str:
    """The one-phrase conclusion: ``no races found``, or why that would not be a pass."""
    v = verdict(report)
    n = report["summary"]["races"]
    if v == RACES_FOUND:
        return f"{n} CUDA stream race{'' if n == 1 else 's'} found"
    if v == INCOMPLETE_REPORT:
        return "no races found, but the report is incomplete"
    if v == NOTHING_CHECKED_REPORT:
        return "nothing was checked: no CUDA stream work was traced"
    return "no races found"


def fail_on_race_exit(report: dict, allow_incomplete: bool = False) -> tuple[int, str]:
    """The exit code under ``--fail-on-race`` and, when it fails without races, the line saying why."""
    v = verdict(report)
    if v == RACES_FOUND:
        return RACES, ""
    if allow_incomplete or v == PASSED:
        return OK, ""
    if v == INCOMPLETE_REPORT:
        return INCOMPLETE, (f"streamsan: --fail-on-race: no race found, but the report is incomplete (exit "
                            f"{INCOMPLETE}; --allow-incomplete passes it)")
    return NOTHING_CHECKED, (f"streamsan: --fail-on-race: no race found, but nothing was checked: no CUDA stream "
                             f"work was traced (exit {NOTHING_CHECKED}; --allow-incomplete passes it)")
