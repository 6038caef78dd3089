"""The parent side of ``streamsan confirm``: the runs of the program and the ``confirmation`` of each finding.

Cost: two unperturbed runs (a third when the first two disagree, to learn which values vary on their own), then
one run per finding that a delay can reach; ``--finding`` picks the findings, ``--occurrences`` how many
occurrences of the delayed call site each run delays. Every run observes the same sites, so runs differ only in
the delay. A run is started by a *runner*, ``runner(cmd, env) -> (exit code, standard output)``, with the confirm
runtime loaded through the bootstrap directory (:mod:`.runtime`) and no tracing.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import subprocess
import tempfile

from ..wrap import BOOTSTRAP_DIR
from . import runtime
from .decide import INCONCLUSIVE, STDOUT, Run, decide
from .plan import observed_sites, plan

METHOD = "gpu-delay"
DEFAULT_DELAY_MS = 20.0


def run_quietly(cmd: list, env: dict) -> tuple:
    """The default runner: the command with its standard output captured and its standard error dropped."""
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return proc.returncode, proc.stdout.decode(errors="replace")


def run_env(spec_path: str, base=None) -> dict:
    """A confirm run's environment: ``base`` (default: ours) with the bootstrap directory first on PYTHONPATH,
    the run spec named, and no streamsan session (the run is not traced)."""
    env = dict(os.environ if base is None else base)
    env.pop("STREAMSAN_SESSION_DIR", None)
    env[runtime.ENV] = spec_path
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + rest if rest else "")
    return env


def read_observations(out_dir: str, exit_code: int, stdout: str) -> Run:
    """One run as a :class:`Run` from the observation files its processes wrote (keys of a second process on
    are prefixed with its place in pid order)."""
    files = []
    for path in glob.glob(os.path.join(out_dir, "observed-*.json")):
        with open(path) as f:
            files.append(json.load(f))
    if not files:
        return Run(exit_code, stdout, (), {}, 0, "no process wrote observations (is the command a Python "
                                                 "program that imports torch or cupy?)")
    files.sort(key=lambda o: o["pid"])
    sequence, values, delayed, errors = [], {}, 0, []
    for i, obs in enumerate(files):
        prefix = f"process {i + 1}: " if len(files) > 1 else ""
        names = [prefix + s for s in obs["sites"]]
        sequence += [names[s] for s in obs["sequence"]]
        values.update(((names[s], occ), tuple(v)) for s, occ, v in obs["values"])
        delayed += obs["delayed"]
        if obs.get("error"):
            errors.append(obs["error"])
        elif obs.get("truncated"):
            errors.append("too many observed ops: the run's observations were cut short")
    return Run(exit_code, stdout, tuple(sequence), values, delayed, "; ".join(errors) or None)


class Confirmer:
    """Runs ``cmd`` for the probes of a report. ``say``: a callable given one progress line per run."""

    def __init__(self, cmd: list, *, delay_ms: float = DEFAULT_DELAY_MS, occurrences: int | None = None,
                 runner=None, say=None, env=None):
        self.cmd = list(cmd)
        self.delay_ms = delay_ms
        self.occurrences = occurrences
        self.runner = runner or run_quietly
        self.say = say or (lambda line: None)
        self.env = env
        self.runs = 0

    def _run(self, sites: list, delay_site: int | None, what: str) -> Run:
        self.runs += 1
        self.say(f"run {self.runs}: {what}")
        with tempfile.TemporaryDirectory(prefix="streamsan-confirm-") as out_dir:
            spec = {"sites": [s.as_json() for s in sites], "delay_site": delay_site, "delay_ms": self.delay_ms,
                    "occurrences": self.occurrences, "out_dir": out_dir}
            spec_path = os.path.join(out_dir, "spec.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            code, stdout = self.runner(self.cmd, run_env(spec_path, self.env))
            return read_observations(out_dir, code, stdout)

    def baselines(self, sites: list) -> list:
        runs = [self._run(sites, None, "unperturbed"), self._run(sites, None, "unperturbed, again")]
        a, b = runs
        if (a.sequence, a.values, a.stdout, a.exit_code) != (b.sequence, b.values, b.stdout, b.exit_code):
            runs.append(self._run(sites, None, "unperturbed, a third time (the first two disagree)"))
        return runs

    def confirm(self, report: dict, fingerprints=()) -> dict:
        """A copy of the report with a ``confirmation`` in each finding probed."""
        probes = plan(report, fingerprints)
        reachable = [p for p in probes if p.delay is not None]
        sites = observed_sites(reachable)
        labels = {s.key(): s for s in sites}
        baselines = self.baselines(sites) if reachable else []
        out = copy.deepcopy(report)
        by_fp = {r["fingerprint"]: r for r in out["races"]}
        for probe in probes:
            race = by_fp[probe.fingerprint]
            if probe.delay is None:
                race["confirmation"] = self._item(probe, INCONCLUSIVE, probe.unreachable, [], 0, None, 0)
                continue
            delay_site = sites.index(probe.delay)
            what = f"{self.delay_ms:g} ms before {probe.delay.key()} on {probe.stream} ({probe.fingerprint})"
            run = self._run(sites, delay_site, what)
            d = decide(baselines, run, [s.key() for s in probe.observed])
            evidence = [_evidence(e, labels) for e in d.evidence]
            race["confirmation"] = self._item(probe, d.outcome, d.reason, evidence, d.compared, run.delayed,
                                              len(baselines))
        return out

    def _item(self, probe, outcome, reason, evidence, compared, delayed, baselines) -> dict:
        delay = None
        if probe.delay is not None:
            delay = {"ms": self.delay_ms, "stream": probe.stream, "op": probe.delay.op,
                     "location": probe.delay.location, "occurrences": delayed, "limit": self.occurrences}
        return {"method": METHOD, "outcome": outcome, "reason": reason, "delay": delay,
                "observed": [s.as_json() for s in probe.observed],
                "runs": {"baselines": baselines, "perturbed": 1 if probe.delay is not None else 0},
                "compared": compared, "evidence": evidence}


def _evidence(entry: dict, labels: dict) -> dict:
    """A decision's evidence entry for the report: what changed (an op's output at a call site, a named value,
    the standard output) and how much."""
    label = entry["site"]
    process, _, rest = label.partition(": ") if label.startswith("process ") else ("", "", label)
    item = {"what": "op", "op": None, "location": None, "name": None}
    if rest == STDOUT:
        item["what"] = "stdout"
    elif rest.startswith("observe(") and rest not in labels:
        item.update(what="observed", name=rest[len("observe("):-1])
    else:
        site = labels[rest]
        item.update(op=site.op, location=site.location)
    item["process"] = int(process.split()[1]) if process else None
    item.update((k, entry[k]) for k in ("changed", "occurrences", "first_changed", "largest_difference"))
    return item
