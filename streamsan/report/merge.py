"""Merge reports (one per traced process, or several runs) into one ``streamsan.report/1`` report."""

from __future__ import annotations

import time

from .build import COUNTERS, SCHEMA, summarize, version


def _process_entries(report: dict) -> list:
    if report.get("processes"):
        return [dict(p) for p in report["processes"]]
    s = report["summary"]
    return [{"pid": None, "command": report["command"], "complete": report.get("complete", True),
             "problems": list(report.get("problems", [])), "events": s.get("events", 0),
             "races": len(report["races"]), "occurrences": s.get("occurrences", 0)}]


def _add(items: dict, race: dict) -> None:
    """Add a race item to ``items`` (by fingerprint): the first item is kept, counts summed, tests joined."""
    seen = items.get(race["fingerprint"])
    if seen is None:
        items[race["fingerprint"]] = dict(race)
        return
    seen["count"] += race["count"]
    if "tests" in race:
        seen["tests"] = seen.get("tests", []) + [t for t in race["tests"] if t not in seen.get("tests", [])]


def merge_reports(reports, *, command=None, environment=None) -> dict:
    """One report from several: races (and suppressed races) deduplicated by fingerprint (the first item kept,
    counts summed), counters summed, notes deduplicated, complete only if all are, and one ``processes`` entry
    per traced process. ``command`` / ``environment`` default to the first report's."""
    reports = list(reports)
    races: dict[str, dict] = {}
    suppressed: dict[str, dict] = {}
    notes: list = []
    problems: list = []
    processes: list = []
    counters = dict.fromkeys(COUNTERS, 0)
    for r in reports:
        for race in r["races"]:
            _add(races, race)
        for race in r.get("suppressed", []):
            _add(suppressed, race)
        for n in r.get("notes", []):
            if n not in notes:
                notes.append(n)
        problems.extend(r.get("problems", []))
        processes.extend(_process_entries(r))
        for k in COUNTERS:
            counters[k] += r["summary"].get(k, 0)
    first = reports[0] if reports else {}
    race_list = list(races.values())
    any_suppressed = any("suppressed" in r for r in reports)
    merged = {
        "schema": SCHEMA,
        "streamsan_version": version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": list(command if command is not None else first.get("command", [])),
        "environment": dict(environment if environment is not None else first.get("environment", {})),
        "complete": all(r.get("complete", True) for r in reports),
        "problems": problems,
        "notes": notes,
        "summary": summarize(race_list, counters, processes=len(processes),
                             suppressed=len(suppressed) if any_suppressed else None),
        "races": race_list,
        "processes": processes,
    }
    if any_suppressed:
        merged["suppressed"] = list(suppressed.values())
    return merged
