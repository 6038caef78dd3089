"""A report as a SARIF 2.1.0 log, for code-scanning dashboards: one rule per finding kind, one result per
finding (suppressed ones too, marked with SARIF suppressions) located at the later access's user frame, with
the earlier access as a related location and both as a two-step code flow."""

from __future__ import annotations

import os
from urllib.parse import quote

from ..analysis.findings import KINDS
from .advice import agent_text
from .build import version
from .render_text import action

SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
ROOT_ID = "SRCROOT"
RULES = {
    "device-device": ("Two streams access the same memory without an ordering between them",
                      "Make the later stream wait for the earlier one (wait_stream, or an event record and wait)."),
    "host-device": ("The host and a stream access the same memory without a synchronization between them",
                    "Synchronize the stream (or an event recorded after its work) before the host access."),
    "alloc-reuse": ("Memory freed and allocated again while a stream may still use it",
                    "Call record_stream on the freed tensor for every stream that used it, or wait for them."),
    "missing-record-stream": ("A tensor used on another stream was freed without record_stream",
                              "Call tensor.record_stream(stream) after the use, or make the owner stream wait."),
}


def _camel(kind: str) -> str:
    return "".join(p.capitalize() for p in kind.split("-"))


def _rule(kind: str) -> dict:
    short, help_text = RULES.get(kind, (f"CUDA stream race ({kind})", "See the finding's fix."))
    return {"id": kind, "name": _camel(kind), "shortDescription": {"text": short},
            "help": {"text": help_text}, "defaultConfiguration": {"level": "error"}}


def _artifact(path: str, root: str | None) -> dict:
    if root and os.path.isabs(path):
        rel = os.path.relpath(path, root)
        if not rel.startswith(".."):
            return {"uri": quote(rel.replace(os.sep, "/")), "uriBaseId": ROOT_ID}
    if os.path.isabs(path):
        return {"uri": "file://" + quote(path.replace(os.sep, "/"))}
    return {"uri": quote(path.replace(os.sep, "/"))}


def _location(a: dict, root: str | None, text: str) -> dict:
    """The access's innermost user-code frame (its op name alone when no source frame was recorded)."""
    loc: dict = {"message": {"text": text}}
    frame = next(iter(a.get("stack") or []), None)
    if frame is not None and not frame["file"].startswith("<"):
        physical = {"artifactLocation": _artifact(frame["file"], root)}
        if frame["line"] >= 1:
            physical["region"] = {"startLine": frame["line"]}
        loc["physicalLocation"] = physical
        loc["logicalLocations"] = [{"name": frame["function"], "kind": "function"}]
    else:
        loc["logicalLocations"] = [{"name": a["op"], "kind": "function"}]
    return loc


def _access_text(a: dict, which: str) -> str:
    return f"{which} access: {action(a)} on {agent_text(a['agent'])} at {a['location']}"


def _result(r: dict, rule_index: dict, root: str | None) -> dict:
    cur, prev = r["access"], r["previous_access"]
    later = _location(cur, root, _access_text(cur, "later"))
    earlier = dict(_location(prev, root, _access_text(prev, "earlier")), id=1)
    out = {
        "ruleId": r["kind"],
        "ruleIndex": rule_index[r["kind"]],
        "level": "error",
        "message": {"text": f"{r['missing_edge']} Fix: {r['fix']}"},
        "locations": [later],
        "relatedLocations": [earlier],
        "codeFlows": [{"threadFlows": [{"locations": [
            {"location": {k: v for k, v in earlier.items() if k != "id"}}, {"location": later}]}]}],
        "partialFingerprints": {"streamsanFingerprint/v1": r["fingerprint"]},
        "occurrenceCount": r["count"],
        "properties": {"memory": r["memory"]},
    }
    if "suppression" in r:
        s = r["suppression"]
        out["suppressions"] = [{"kind": "external", "status": "accepted",
                                "justification": f"{s['reason']} ({s['rule']}, {s['file']}:{s['line']})"}]
    return out


def render_sarif(report: dict, root: str | None = None) -> dict:
    """The SARIF log (a dict) of a report. ``root``: source root; frames under it get paths relative to it
    (``uriBaseId`` SRCROOT), as code-scanning services want; other frames get absolute file URIs."""
    items = report["races"] + report.get("suppressed", [])
    kinds = list(KINDS) + sorted({r["kind"] for r in items} - set(KINDS))
    rule_index = {k: i for i, k in enumerate(kinds)}
    notes = [{"level": "warning" if n["level"] == "warning" else "note", "message": {"text": n["text"]}}
             for n in report.get("notes", [])]
    notes += [{"level": "warning", "message": {"text": f"incomplete: {p}"}} for p in report.get("problems", [])]
    tool_version = report.get("streamsan_version") or version()
    run = {
        "tool": {"driver": {"name": "streamsan", "version": tool_version, "semanticVersion": tool_version,
                            "rules": [_rule(k) for k in kinds]}},
        "invocations": [{"executionSuccessful": bool(report.get("complete", True)),
                         "commandLine": " ".join(report.get("command", [])),
                         "toolExecutionNotifications": notes}],
        "results": [_result(r, rule_index, root) for r in items],
        "properties": {"summary": report["summary"]},
    }
    if root:
        run["originalUriBaseIds"] = {ROOT_ID: {"uri": "file://" + quote(root.rstrip(os.sep).replace(os.sep, "/"))
                                               + "/"}}
    return {"$schema": SCHEMA_URI, "version": "2.1.0", "runs": [run]}
