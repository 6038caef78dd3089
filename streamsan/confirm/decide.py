"""The decision over one finding's runs: confirmed, not confirmed or inconclusive. A pure function of the
observations (no GPU, no files), so that every case is tested on the CPU.

A run is summarized as a :class:`Run`: its exit code, standard output, the sequence of observed sites in program
order, and the checksum of each (site, occurrence). Values are compared exactly (a checksum is computed the same
way on the same data in every run). A value is *stable* when every baseline has it equal; only a stable value
that differs under the delay is evidence, so the outcome is never ``confirmed`` without an observed difference.
The outcome is ``inconclusive`` when the runs cannot be compared (a baseline or the perturbed run failed, the
baselines end differently or take different paths, the delayed site was not reached, the perturbed run took
another path) or when the finding's own sites vary on their own and nothing stable changed.
"""

from __future__ import annotations

from typing import NamedTuple

CONFIRMED, NOT_CONFIRMED, INCONCLUSIVE = "confirmed", "not-confirmed", "inconclusive"
OUTCOMES = (CONFIRMED, NOT_CONFIRMED, INCONCLUSIVE)
STDOUT = "standard output"


class Run(NamedTuple):
    """One run's observations. ``values``: (site, occurrence) -> checksum tuple; ``delayed``: how many
    occurrences were delayed; ``error``: why its observations are missing or partial (None: complete)."""

    exit_code: int
    stdout: str
    sequence: tuple
    values: dict
    delayed: int = 0
    error: str | None = None


class Decision(NamedTuple):
    outcome: str
    reason: str | None
    evidence: list  # for confirmed: one entry per site (or the standard output) whose values changed
    compared: int  # stable values compared


def _first_difference(a: tuple, b: tuple) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"observed op {i + 1} is {y} instead of {x}"
    return f"{len(b)} observed ops instead of {len(a)}"


def _difference(a, b):
    """The change of a checksum's sum of values, where both are numbers."""
    if a and b and a[0] is not None and b[0] is not None:
        return abs(b[0] - a[0])
    return None


def decide(baselines: list, perturbed: Run, own_sites=()) -> Decision:
    """The outcome of one finding from its unperturbed runs (at least one) and its perturbed run.
    ``own_sites``: the finding's observed sites (their values varying on their own makes it inconclusive)."""
    base = baselines[0]
    for b in baselines:
        if b.error:
            return Decision(INCONCLUSIVE, f"an unperturbed run failed ({b.error})", [], 0)
    codes = sorted({b.exit_code for b in baselines})
    if len(codes) > 1:
        return Decision(INCONCLUSIVE, f"the unperturbed runs end differently (exit codes {codes})", [], 0)
    for b in baselines[1:]:
        if b.sequence != base.sequence:
            return Decision(INCONCLUSIVE, "the control flow differs between unperturbed runs ("
                            f"{_first_difference(base.sequence, b.sequence)})", [], 0)
    if perturbed.exit_code != base.exit_code:
        return Decision(INCONCLUSIVE, f"the program failed under the delay (exit code {perturbed.exit_code}, "
                        f"{base.exit_code} without it)", [], 0)
    if perturbed.error:
        return Decision(INCONCLUSIVE, f"the perturbed run failed ({perturbed.error})", [], 0)
    if perturbed.delayed == 0:
        return Decision(INCONCLUSIVE, "the delayed call site was not reached in the perturbed run", [], 0)
    if perturbed.sequence != base.sequence:
        return Decision(INCONCLUSIVE, "the control flow diverged under the delay ("
                        f"{_first_difference(base.sequence, perturbed.sequence)})", [], 0)

    changed: dict = {}  # site -> [changed occurrences, first, largest difference]
    totals: dict = {}
    unstable_own = set()
    compared = 0
    own = set(own_sites)
    for key, value in base.values.items():
        site, occurrence = key
        totals[site] = totals.get(site, 0) + 1
        if any(b.values.get(key) != value for b in baselines[1:]):
            if site in own:
                unstable_own.add(site)
            continue
        if key not in perturbed.values:
            continue
        compared += 1
        after = perturbed.values[key]
        if after != value:
            entry = changed.setdefault(site, [0, occurrence, None])
            entry[0] += 1
            entry[1] = min(entry[1], occurrence)
            d = _difference(value, after)
            if d is not None:
                entry[2] = d if entry[2] is None else max(entry[2], d)
    stdout_stable = all(b.stdout == base.stdout for b in baselines[1:])
    if stdout_stable:
        compared += 1
    evidence = [{"site": site, "changed": n, "occurrences": totals[site], "first_changed": first,
                 "largest_difference": largest}
                for site, (n, first, largest) in sorted(changed.items(), key=lambda kv: (kv[0] not in own, kv[0]))]
    if stdout_stable and perturbed.stdout != base.stdout:
        evidence.append({"site": STDOUT, "changed": 1, "occurrences": 1, "first_changed": 1,
                         "largest_difference": None})
    if evidence:
        return Decision(CONFIRMED, None, evidence, compared)
    if unstable_own:
        sites = ", ".join(sorted(unstable_own))
        return Decision(INCONCLUSIVE, f"the values at {sites} vary between unperturbed runs, and no stable value "
                        "changed", [], compared)
    if compared == 0:
        return Decision(INCONCLUSIVE, "nothing could be compared (no value observed, and the standard output "
                        "varies between unperturbed runs)", [], 0)
    return Decision(NOT_CONFIRMED, None, [], compared)
