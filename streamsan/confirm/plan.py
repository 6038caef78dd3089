"""Which perturbation confirms which finding: the call site and stream to delay, and the call sites to observe.

A call site is what findings are deduplicated on: the innermost user frame's ``path:line`` (as
:func:`streamsan.analysis.locations.location` spells it) plus the op's name. For every kind the delay goes on the
stream of the earlier access, right before its op: for a race that flips the pair; for a missing ``record_stream``
or an allocator reuse the earlier access is the foreign stream's use of the freed block, so delaying it lets the
block's next owner write first. The observed sites are both accesses' call sites (an ``allocation``, which is no
op, is observed as every op at its line). A finding whose earlier access no GPU delay can hold back (the host's,
or an op that the confirm runtime cannot intercept, such as a CUDA graph replay) gets a probe without a delay and a
reason, and is decided inconclusive without a run.
"""

from __future__ import annotations

from dataclasses import dataclass

# Prefixes of the op names the confirm runtime intercepts: aten ops (a dispatch mode) and CuPy calls (the CuPy
# tracer's traced surfaces).
REACHABLE_PREFIXES = ("aten::", "cupy.")
ALLOCATION = "allocation"


class PlanError(Exception):
    """A finding asked for is not in the report; the message is one line."""


@dataclass(frozen=True)
class Site:
    """A call site: ``location`` (``path:line``) and ``op`` (None: any op at that line)."""

    location: str
    op: str | None

    def key(self) -> str:
        return f"{self.op or '*'} @ {self.location}"

    def matches(self, location: str, op: str) -> bool:
        return location == self.location and (self.op is None or self.op == op)

    def as_json(self) -> dict:
        return {"location": self.location, "op": self.op}


@dataclass(frozen=True)
class Probe:
    """The perturbation of one finding. ``delay``: the call site delayed (None: none can be, ``unreachable``
    says why); ``stream``: the delayed stream as the report names it; ``observed``: the sites whose outputs are
    compared."""

    fingerprint: str
    kind: str
    delay: Site | None
    stream: str
    observed: tuple
    unreachable: str | None = None


def stream_name(agent: dict) -> str:
    """How a report's agent item is named in a sentence: ``the default stream``, ``stream prefetch_stream``."""
    if agent.get("kind") == "host":
        return "the host"
    role = agent.get("role")
    if role == "default":
        return "the default stream"
    return f"stream {role}" if role else f"stream {agent.get('stream')}"


def _site(access: dict) -> Site:
    op = access["op"]
    return Site(access["location"], None if op == ALLOCATION else op)


def probe_for(race: dict) -> Probe:
    """The probe of one race item of a report."""
    prev, cur = race["previous_access"], race["access"]
    observed = tuple(dict.fromkeys((_site(prev), _site(cur))))
    stream = stream_name(prev["agent"])
    why = None
    if prev["agent"].get("kind") == "host":
        why = "the earlier access is the host's: no GPU delay can hold it back"
    elif not prev["op"].startswith(REACHABLE_PREFIXES):
        why = f"the earlier access is {prev['op']}, which confirm cannot delay (only aten ops and CuPy calls)"
    return Probe(race["fingerprint"], race["kind"], None if why else _site(prev), stream, observed, why)


def plan(report: dict, fingerprints=()) -> list:
    """The probes of a report's findings (of those named by ``fingerprints`` if any, in the report's order);
    PlanError names a fingerprint that the report does not have."""
    races = report.get("races", [])
    known = {r["fingerprint"] for r in races}
    missing = [f for f in fingerprints if f not in known]
    if missing:
        have = ", ".join(sorted(known)) or "none"
        raise PlanError(f"no finding with fingerprint {missing[0]} in the report (its fingerprints: {have})")
    wanted = set(fingerprints)
    return [probe_for(r) for r in races if not wanted or r["fingerprint"] in wanted]


def observed_sites(probes: list) -> list:
    """Every site any probe observes or delays, each once, in a fixed order: every run observes all of them,
    so that runs differ only in the delay."""
    sites: dict = {}
    for p in probes:
        for s in p.observed:
            sites.setdefault(s, None)
        if p.delay is not None:
            sites.setdefault(p.delay, None)
    return list(sites)
