"""Merge reports (one per traced process, or several runs) into one ``streamsan.report/1`` report.

What the reports agree on is said once: the merged ``command`` and ``environment`` are the ones they share;
an entry of ``processes`` keeps its own command, and its own environment entries, only where they differ.
"""

from __future__ import annotations

import time

from .build import COUNTERS, SCHEMA, summarize, version


def _process_entries(report: dict) -> list:
    """The report's processes, each with its command line."""
    if report.get("processes"):
        entries = [dict(p) for p in report["processes"]]
    else:
        s = report["summary"]
        entries = [{"pid": None, "complete": report.get("complete", True),
                    "problems": list(report.get("problems", [])), "events": s.get("events", 0),
                    "races": len(report["races"]), "occurrences": s.get("occurrences", 0)}]
    for e in entries:
        e.setdefault("command", list(report["command"]))
    return entries


def _add(items: dict, race: dict) -> None:
    """Add a race item to ``items`` (by fingerprint): the first item is kept, counts summed, tests joined."""
    seen = items.get(race["fingerprint"])
    if seen is None:
        items[race["fingerprint"]] = dict(race)
        return
    seen["count"] += race["count"]
    if "tests" in race:
        seen["tests"] = seen.get("tests", []) + [t for t in race["tests"] if t not in seen.get("tests", [])]


def _shared(values: list):
    """The value all of ``values`` have, else None."""
    return values[0] if values and all(v == values[0] for v in values) else None


def shared_environment(environments: list) -> tuple[dict, list]:
    """(the entries every environment has alike, and per environment the entries where it differs)."""
    first = environments[0] if environments else {}
    alike = {k: v for k, v in first.items() if all(k in env and env[k] == v for env in environments[1:])}
    return alike, [{k: v for k, v in env.items() if k not in alike} for env in environments]


def merge_reports(reports, *, command=None, environment=None) -> dict:
    """One report from several: races (and suppressed races) deduplicated by fingerprint (the first item kept,
    counts summed), counters summed, notes deduplicated, complete only if all are, and one ``processes`` entry
    per traced process. ``command`` / ``environment`` default to what all the reports share (see the module's
    docstring)."""
    reports = list(reports)
    races: dict[str, dict] = {}
    suppressed: dict[str, dict] = {}
    notes: list = []
    problems: list = []
    processes: list = []
    counters = dict.fromkeys(COUNTERS, 0)
    if environment is None:
        environment, differences = shared_environment([dict(r.get("environment", {})) for r in reports])
    else:
        differences = [{} for _ in reports]
    for r, differs in zip(reports, differences):
        for race in r["races"]:
            _add(races, race)
        for race in r.get("suppressed", []):
            _add(suppressed, race)
        for n in r.get("notes", []):
            if n not in notes:
                notes.append(n)
        problems.extend(r.get("problems", []))
        entries = _process_entries(r)
        if differs:
            for e in entries:
                e["environment"] = dict(e.get("environment", {}), **differs)
        processes.extend(entries)
        for k in COUNTERS:
            counters[k] += r["summary"].get(k, 0)
    if command is None:
        command = _shared([list(r["command"]) for r in reports]) or []
    for e in processes:
        if e["command"] == list(command):
            del e["command"]  # (the report's own command: a long one is stored once)
    race_list = list(races.values())
    any_suppressed = any("suppressed" in r for r in reports)
    merged = {
        "schema": SCHEMA,
        "streamsan_version": version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": list(command),
        "environment": dict(environment),
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
